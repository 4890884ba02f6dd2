// The quantizer of the CUDA kernels (normlab/backends/kernels/quantize.cuh) built for the host,
// for test_cuda_quantize.py: the same source, with the hardware's approximate reciprocal (within
// an ulp) stood in for by the exact one moved by up to 64 ulps, so that the division is checked
// from a start far rougher than rcp.approx's.
#include <cmath>

#define __host__
#define __device__
#define __forceinline__ inline

#include "quantize.cuh"

namespace normlab {

float approximate_reciprocal(float m) {
  float r = 1.0f / m;
  const int moves = static_cast<int>(float_bits(m) % 129u) - 64;  // -64 ... 64 ulps
  for (int i = 0; i < (moves < 0 ? -moves : moves); ++i) {
    r = nextafterf(r, moves < 0 ? 0.0f : 2.0f);
  }
  return r;
}

}  // namespace normlab

extern "C" {

// out[i] = divide(y[i], s[i]).
void divide_values(const float* y, const float* s, long long n, float* out) {
  for (long long i = 0; i < n; ++i) {
    out[i] = normlab::divide(y[i], s[i]);
  }
}

// q[i] of y[i] with the row scale s, in mode (0: int8, 1: fp8 e4m3fn bits).
void quantize_values(const float* y, long long n, float s, int mode, unsigned char* q) {
  for (long long i = 0; i < n; ++i) {
    q[i] = normlab::quantize_value(y[i], s, mode);
  }
}

// The dynamic scale of a row y of n values, its max|y| merged pairwise as a warp merges them.
float dynamic_scale_of(const float* y, long long n, int mode) {
  normlab::Amax m{0.0f};
  for (long long i = 0; i < n; ++i) {
    m = normlab::combine(m, normlab::Amax{fabsf(y[i])});
  }
  return normlab::dynamic_scale(m, mode);
}
}
