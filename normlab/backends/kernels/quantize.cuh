// normlab's quantizer (normlab.quantize.reference) on one float32 value of y and one row scale,
// and the row statistic of a dynamic scale, max|y|. Plain C++ on float bits: the functions are
// __host__ __device__, so the tests compile this header with a host compiler too and check it
// against the reference on the CPU (tests/backends/cuda/test_cuda_quantize.py).
//
//   int8:     q = clip(rint(y / s), -127, 127), rounded half to even; NaN -> 0
//   fp8_e4m3: q = the float8 e4m3fn bits of clip(y / s, -448, 448), rounded to nearest even;
//             NaN -> 0x7F with its sign bit
//   s = 0 (a dynamic scale of a row of zeros): q = 0
//
// y / s is the IEEE float32 quotient (divide(): correctly rounded wherever q depends on its
// bits), as the reference divides.
#pragma once

#ifdef __CUDA_ARCH__
#include "reduce.cuh"  // quotient()
#endif

namespace normlab {

// The modes (normlab.spec.quantize.MODES), as the kernels' `mode` argument.
constexpr int QUANTIZE_INT8 = 0;
constexpr int QUANTIZE_FP8_E4M3 = 1;

__host__ __device__ __forceinline__ unsigned int float_bits(float v) {
  union {
    float f;
    unsigned int u;
  } b{v};
  return b.u;
}

__host__ __device__ __forceinline__ bool is_nan(float v) { return v != v; }

// +infinity (NVRTC has no <cmath>, and so no INFINITY).
__host__ __device__ __forceinline__ float positive_infinity() {
  union {
    unsigned int u;
    float f;
  } b{0x7f800000u};
  return b.f;
}

#ifndef __CUDA_ARCH__
// The host tests' stand-in for the hardware's approximate reciprocal (test_cuda_quantize.py).
float approximate_reciprocal(float m);
#else
// An approximation of 1 / m, m in [1, 2) (the hardware's, within an ulp).
__device__ __forceinline__ float approximate_reciprocal(float m) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(m));
  return r;
}
#endif

// Of a faithful quotient q of a / m (within an ulp) and its neighbour on the side of a / m,
// the nearer: the correctly rounded a / m. rem = a - m q is exact (the remainder of a faithful
// quotient is representable), and so are 2 rem and m times the gap (a power of two). No
// quotient of two float32 values lies halfway between two (it would need 25 bits): no ties.
__host__ __device__ __forceinline__ float nearest_quotient(float a, float m, float q) {
  const float rem = fmaf(-m, q, a);
  if (rem == 0.0f) {
    return q;
  }
  const float next = nextafterf(q, rem > 0.0f ? positive_infinity() : -positive_infinity());
  const float gap = fabsf(next - q) * m;
  return fabsf(2.0f * rem) < gap ? q : next;
}

// y / s correctly rounded, for s > 0 (inf and NaN included), with no slow path (an IEEE division calls
// a subroutine for rare operands, and ptxas saves the registers that hold the row around it).
// y = a 2^i and s = m 2^k with a, m in [1, 2) exactly; a r, r an approximate reciprocal of m,
// corrected once by its remainder is within an ulp of a / m (its error is about the square of
// r's), nearest_quotient rounds it (all in (1/2, 2): no operand near float32's limits), and
// 2^(i - k) scales it back: exact wherever y / s is a normal
// float32. Where it is not, y / s is beyond every limit (inf, clipped) or below every bin of q
// (a subnormal of y's sign, twice rounded, quantized as the exact one).
__host__ __device__ __forceinline__ float divide(float y, float s) {
  if (!(s < positive_infinity())) {  // a dynamic scale of a row with inf or NaN in it
    return is_nan(s) ? y + s : y * 0.0f;  // as y / s: NaN; a signed 0, or NaN for y = inf
  }
  if (y == 0.0f || !(fabsf(y) < positive_infinity())) {
    return y * s;  // a signed 0, a signed inf, or NaN
  }
  int i;
  int k;
  const float a = 2.0f * frexpf(y, &i);
  const float m = 2.0f * frexpf(s, &k);
  const float r = approximate_reciprocal(m);
  const float q = a * r;
  return ldexpf(nearest_quotient(a, m, fmaf(fmaf(-m, q, a), r, q)), i - k);
}

// v rounded to an integral value, ties to even (the default rounding mode).
__host__ __device__ __forceinline__ float round_even(float v) { return rintf(v); }

// clip(v, -limit, limit); NaN stays NaN (the comparisons are false), as NumPy's and CuPy's clip.
__host__ __device__ __forceinline__ float clip(float v, float limit) {
  return v < -limit ? -limit : (v > limit ? limit : v);
}

// int8 q of v = y / s, as its byte.
__host__ __device__ __forceinline__ unsigned char int8_of(float v) {
  const float r = clip(round_even(v), 127.0f);
  return static_cast<unsigned char>(static_cast<signed char>(is_nan(r) ? 0.0f : r));
}

// The e4m3fn bits of v, |v| <= 448 or NaN: normal values (|v| >= 2^-6) drop 20 of float32's 23
// mantissa bits, rounded to nearest even (a carry moves into the exponent), and rebias the
// exponent (127 - 7 = 120); smaller ones count units of 2^-9 (8 of them: the smallest normal).
__host__ __device__ __forceinline__ unsigned char e4m3_of(float v) {
  const unsigned int u = float_bits(v);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int a = u & 0x7fffffffu;
  unsigned int bits;
  if (a > 0x7f800000u) {
    bits = 0x7fu;
  } else if (a < 0x3c800000u) {  // below 2^-6
    bits = static_cast<unsigned int>(round_even(fabsf(v) * 512.0f));
  } else {
    bits = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  }
  return static_cast<unsigned char>(sign | bits);
}

// q of y in `mode` for the row scale s (0: q = 0).
__host__ __device__ __forceinline__ unsigned char quantize_value(float y, float s, int mode) {
  if (s == 0.0f) {
    return 0;
  }
  const float v = divide(y, s);
  return mode == QUANTIZE_INT8 ? int8_of(v) : e4m3_of(clip(v, 448.0f));
}

// The largest magnitude q may take in `mode` (normlab.spec.quantize.LIMITS).
__host__ __device__ __forceinline__ float quantize_limit(int mode) {
  return mode == QUANTIZE_INT8 ? 127.0f : 448.0f;
}

// max|y| of a set of values, NaN when one of them is NaN (as NumPy's and CuPy's max). The empty
// set is {0}.
struct Amax {
  float v;
};

// The max of the union of two sets: NaN if either is NaN (the first one's), else the larger.
__host__ __device__ __forceinline__ Amax combine(const Amax& a, const Amax& b) {
  return Amax{is_nan(a.v) ? a.v : (is_nan(b.v) ? b.v : (a.v < b.v ? b.v : a.v))};
}

// A row's dynamic scale from its max|y|: amax / LIMIT correctly rounded (NaN stays NaN). Below
// 2^-100, where the quotient nears float32's subnormals (and divide() would lose bits of a), it
// is formed in double: within an ulp of double, 29 bits finer than any float32 below 2^-100 can
// tell apart from a rounding boundary it is not exactly on, and exact on one.
__host__ __device__ __forceinline__ float dynamic_scale(const Amax& amax, int mode) {
  const float limit = quantize_limit(mode);
  if (amax.v < 0x1p-100f) {
#ifdef __CUDA_ARCH__
    return static_cast<float>(quotient(static_cast<double>(amax.v), static_cast<double>(limit)));
#else
    return static_cast<float>(static_cast<double>(amax.v) / static_cast<double>(limit));
#endif
  }
  return divide(amax.v, limit);
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ Amax shuffle_xor(const Amax& s, int offset) {
  return Amax{__shfl_xor_sync(0xffffffffu, s.v, offset)};
}
#endif

}  // namespace normlab
