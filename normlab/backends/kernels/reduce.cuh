// The statistics of a row, and the rules that merge the statistics of two parts of it:
//   SquareSum  sum(v^2)                              merged by addition    (RMSNorm)
//   Sums       N sums                                merged by addition    (LayerNorm's two
//                                                    reductions, the backward's row sums)
//
// Every normlab kernel reduces a row the same way: each thread computes the statistic of the
// values it holds (from its registers, adding them in chunk order), then the threads of a row
// merge those statistics pairwise with combine(), first across the lanes of a warp
// (warp_combine), then across the warps of a row (row_combine). The merge order is fixed by lane
// and warp index, so every thread ends with bitwise the same row statistic and the result
// depends only on the row length, never on other rows.
#pragma once

namespace normlab {

// Division and inverse square root without IEEE slow paths. The IEEE operators (/, sqrt) call a
// subroutine for rare operands; around that call ptxas saves the row held in registers to the
// stack, which shows as spills in the resource report. These are Newton-refined hardware
// approximations instead: within an ulp or so of the IEEE result and, like all the arithmetic
// here, deterministic.

// a / b for a count b >= 1 (any a).
__device__ __forceinline__ float quotient(float a, float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  r = fmaf(fmaf(-b, r, 1.0f), r, r);
  const float q = a * r;
  return fmaf(fmaf(-b, q, a), r, q);
}
__device__ __forceinline__ double quotient(double a, double b) {
  double r;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(b));
  r = fma(fma(-b, r, 1.0), r, r);
  r = fma(fma(-b, r, 1.0), r, r);
  const double q = a * r;
  return fma(fma(-b, q, a), r, q);
}

// One Newton step r <- r + r * (1 - v r^2) / 2 towards 1 / sqrt(v).
template <typename A>
__device__ __forceinline__ A newton_rsqrt(A v, A r) {
  const A e = fma(-v * r, r, A(1));
  return fma(A(0.5) * r, e, r);
}

// 1 / sqrt(v) for v >= 0 (inf for 0, 0 for inf, NaN for NaN).
__device__ __forceinline__ float inverse_sqrt(float v) {
  float r;
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(v));  // handles subnormal v
  return v > 0.0f && v < __int_as_float(0x7f800000) ? newton_rsqrt(v, r) : r;
}
__device__ __forceinline__ double inverse_sqrt(double v) {
  // The f64 approximation flushes subnormals: scale them up by 2^108 (and the result by 2^54).
  const bool tiny = v < 2.2250738585072014e-308;
  const double s = tiny ? v * 0x1p108 : v;
  double r;
  asm("rsqrt.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(s));
  if (s > 0.0 && s < __longlong_as_double(0x7ff0000000000000ll)) {
    r = newton_rsqrt(s, newton_rsqrt(s, newton_rsqrt(s, r)));
  }
  return tiny ? r * 0x1p54 : r;
}

// Sum of the squares of a set of values (about zero: nothing is subtracted). The empty set is {0}.
template <typename A>
struct SquareSum {
  A sum;
};

// The sum of squares of the union of two disjoint sets: sum = sum_a + sum_b. Exact when either
// side is empty, and the same bits in either order (IEEE addition commutes).
template <typename A>
__device__ __forceinline__ SquareSum<A> combine(const SquareSum<A>& a, const SquareSum<A>& b) {
  return SquareSum<A>{a.sum + b.sum};
}

template <typename A>
__device__ __forceinline__ SquareSum<A> shuffle_xor(const SquareSum<A>& s, int offset) {
  return SquareSum<A>{__shfl_xor_sync(0xffffffffu, s.sum, offset)};
}

// N independent sums (the backward's row sums: of d, g and g * d for LayerNorm, of g * d for
// RMSNorm). The empty set is all zeros.
template <typename A, int N>
struct Sums {
  A v[N];
};

// The sums of the union of two disjoint sets: added member by member. Exact when either side is
// empty, and the same bits in either order.
template <typename A, int N>
__device__ __forceinline__ Sums<A, N> combine(const Sums<A, N>& a, const Sums<A, N>& b) {
  Sums<A, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    r.v[j] = a.v[j] + b.v[j];
  }
  return r;
}

template <typename A, int N>
__device__ __forceinline__ Sums<A, N> shuffle_xor(const Sums<A, N>& s, int offset) {
  Sums<A, N> r;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    r.v[j] = __shfl_xor_sync(0xffffffffu, s.v[j], offset);
  }
  return r;
}

// Merges the statistics S (SquareSum or Sums) of the 32 lanes of a warp (a butterfly over
// lane-index bits). At each step the lower lane group's statistic is the first argument of
// combine on both partners, so every lane computes the same operations in the same order and
// ends with the same bits.
template <typename S>
__device__ __forceinline__ S warp_combine(S m) {
  const unsigned lane = threadIdx.x & 31u;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const S other = shuffle_xor(m, offset);
    m = (lane & offset) ? combine(other, m) : combine(m, other);
  }
  return m;
}

// Merges the statistics S of the WARPS warps that share one row. Partial: shared memory of WARPS
// entries for this row; warp: the caller's warp index within the row. Every warp of the row
// merges all partials in the same order, so all threads of the row end with the same bits.
// When WARPS > 1 it holds two __syncthreads(): every thread of the block must call it, equally
// often; Partial may be reused as soon as it returns.
template <int WARPS, typename S>
__device__ __forceinline__ S row_combine(S m, S* Partial, int warp) {
  m = warp_combine(m);
  if (WARPS == 1) {
    return m;
  }
  const int lane = static_cast<int>(threadIdx.x & 31u);
  if (lane == 0) {
    Partial[warp] = m;
  }
  __syncthreads();
  S mine{};  // the empty set: all zeros
  if (lane < WARPS) {
    mine = Partial[lane];
  }
  __syncthreads();
  return warp_combine(mine);
}

}  // namespace normlab
