// The row code of the forward kernels, shared by LayerNorm/RMSNorm (layer_norm.cu) and the fused
// residual add + norm (add_norm.cu): a thread's chunks of a row loaded and shifted, their
// statistic, the row's rstd and mean, and y written from the chunks.
#pragma once

#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// Loads one thread's ITEMS chunks of a row (chunk i at column first + i * step; `cols` columns
// in all) into D, and the number of columns of each chunk inside the row into N. CENTRE: shifted,
// D = x - x0 (0 for columns past the row); else D = x (0 past the row).
template <bool CENTRE, bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void load_thread_chunks(
    const T* Row, long long first, long long step, long long cols, A x0, A (&D)[ITEMS][VEC],
    int (&N)[ITEMS]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    N[i] = chunk_count<VEC>(first + i * step, cols);
    load_chunk<VECTOR>(Row, first + i * step, N[i], x0, D[i]);
  }
  if constexpr (CENTRE) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        D[i][k] -= x0;
      }
    }
  }
}

// The statistic a row is reduced to: Moments for LayerNorm (CENTRE), SquareSum for RMSNorm.
template <bool CENTRE, typename A>
struct RowStatistic {
  using type = Moments<A>;
};
template <typename A>
struct RowStatistic<false, A> {
  using type = SquareSum<A>;
};

// The statistic of the first N[i] values of each chunk D[i]. CENTRE: exact Moments (a plain
// two-pass over registers: the mean, then the sum of squared deviations from it); else the
// SquareSum.
template <bool CENTRE, int ITEMS, int VEC, typename A>
__device__ __forceinline__ typename RowStatistic<CENTRE, A>::type thread_statistic(
    const A (&D)[ITEMS][VEC], const int (&N)[ITEMS]) {
  if constexpr (CENTRE) {
    A sum = A(0);
    int count = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      count += N[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        sum += k < N[i] ? D[i][k] : A(0);
      }
    }
    const A n = static_cast<A>(count);
    const A mean = count > 0 ? quotient(sum, n) : A(0);
    A m2 = A(0);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A e = D[i][k] - mean;
        m2 += k < N[i] ? e * e : A(0);
      }
    }
    return Moments<A>{n, mean, m2};
  } else {
    A sum = A(0);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        sum += k < N[i] ? D[i][k] * D[i][k] : A(0);
      }
    }
    return SquareSum<A>{sum};
  }
}

// rstd = 1 / sqrt(var + eps) of a row's Moments, 1 / sqrt(mean(x^2) + eps) of its SquareSum.
template <typename A>
__device__ __forceinline__ A row_rstd(const Moments<A>& m, long long, A eps) {
  return inverse_sqrt(quotient(m.m2, m.n) + eps);
}
template <typename A>
__device__ __forceinline__ A row_rstd(const SquareSum<A>& s, long long cols, A eps) {
  return inverse_sqrt(quotient(s.sum, static_cast<A>(cols)) + eps);
}

// The mean of D over the row: mean(x - x0) for Moments; 0 for a SquareSum (nothing subtracted).
template <typename A>
__device__ __forceinline__ A row_mean_d(const Moments<A>& m) {
  return m.mean;
}
template <typename A>
__device__ __forceinline__ A row_mean_d(const SquareSum<A>&) {
  return A(0);
}

// Writes one thread's chunks D (as loaded by load_thread_chunks) to the row Y: CENTRE,
// y = (d - mean_d) * rstd * w + b; else y = d * rstd * w (B unused). w = 1 when W is nullptr,
// b = 0 when B is nullptr.
template <bool CENTRE, bool VECTOR, int ITEMS, int VEC, typename T, typename P, typename A>
__device__ __forceinline__ void write_chunks(
    T* Y, const P* __restrict__ W, const P* __restrict__ B, const A (&D)[ITEMS][VEC],
    const int (&N)[ITEMS], long long first, long long step, A mean_d, A rstd) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const long long c = first + i * step;
    A w[VEC];
    load_chunk<VECTOR>(W, c, W != nullptr ? N[i] : 0, A(1), w);
    A y[VEC];
    if constexpr (CENTRE) {
      A b[VEC];
      load_chunk<VECTOR>(B, c, B != nullptr ? N[i] : 0, A(0), b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[k] = (D[i][k] - mean_d) * rstd * w[k] + b[k];
      }
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[k] = D[i][k] * rstd * w[k];
      }
    }
    store_chunk<VECTOR>(Y, c, N[i], y);
  }
}

}  // namespace normlab
