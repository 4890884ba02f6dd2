// The row code of the forward kernels, shared by LayerNorm/RMSNorm (layer_norm.cu), the fused
// residual add + norm (add_norm.cu) and the quantizing kernels (quantize.cu): a thread's chunks
// of a row loaded (unshifted), the row's reductions (LayerNorm: the corrected two-pass, two
// reductions; RMSNorm: one) over registers or in sweeps, its mean and rstd, and y formed from
// the chunks.
#pragma once

#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// Loads one thread's ITEMS chunks of a row (chunk i at column first + i * step; `cols` columns
// in all) into V, as they are: V = x converted to A (0 for columns past the row, which the
// statistics and the stores skip), and the number of columns of each chunk inside the row into N.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void load_thread_chunks(
    const T* Row, long long first, long long step, long long cols, A (&V)[ITEMS][VEC],
    int (&N)[ITEMS]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    N[i] = chunk_count<VEC>(first + i * step, cols);
    load_chunk<VECTOR>(Row, first + i * step, N[i], A(0), V[i]);
  }
}

// h = x + r rounded to T, as an accumulator value (exact: h is a value of T).
template <typename T, typename A>
__device__ __forceinline__ A rounded_sum(A x, A r) {
  return to_acc(from_acc<T>(x + r));
}

// Loads one thread's ITEMS chunks of h = x + r (chunk i at column first + i * step; `cols`
// columns in all) into V, unshifted (as load_thread_chunks loads x: 0 for columns past the row),
// and the number of columns of each chunk inside the row into N.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void load_sum_chunks(
    const T* X, const T* R, long long first, long long step, long long cols, A (&V)[ITEMS][VEC],
    int (&N)[ITEMS]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    N[i] = chunk_count<VEC>(first + i * step, cols);
    A r[VEC];
    load_chunk<VECTOR>(X, first + i * step, N[i], A(0), V[i]);
    load_chunk<VECTOR>(R, first + i * step, N[i], A(0), r);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      V[i][k] = rounded_sum<T>(V[i][k], r[k]);
    }
  }
}

// Writes the first N[i] values of each chunk V[i] (h, exact in T) to the row H.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void store_chunks(
    T* H, const A (&V)[ITEMS][VEC], const int (&N)[ITEMS], long long first, long long step) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    store_chunk<VECTOR>(H, first + i * step, N[i], V[i]);
  }
}

// The shared-memory slots of one row's reductions (row_combine): CENTRE, one for the shifted sum
// and one for the deviation sums, the second reduction of the row; else one for its SquareSum.
template <bool CENTRE, typename A, int WARPS>
struct RowPartials {
  Sums<A, 1> shifted[WARPS];
  Sums<A, 2> deviations[WARPS];
};
template <typename A, int WARPS>
struct RowPartials<false, A, WARPS> {
  SquareSum<A> squares[WARPS];
};

// The first N[i] values of each chunk V[i], reduced per thread (each thread adds its values in
// chunk order, one rounding a term; the threads then merge their sums with row_combine):
//   shifted_sum     sum(v - x0)                          LayerNorm, first reduction
//   deviation_sums  sum(d), sum(d^2) with d = v - m       LayerNorm, second reduction
//   square_sum      sum(v^2)                              RMSNorm
template <int ITEMS, int VEC, typename A>
__device__ __forceinline__ Sums<A, 1> shifted_sum(
    const A (&V)[ITEMS][VEC], const int (&N)[ITEMS], A x0) {
  A sum = A(0);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sum += k < N[i] ? V[i][k] - x0 : A(0);
    }
  }
  return Sums<A, 1>{{sum}};
}
template <int ITEMS, int VEC, typename A>
__device__ __forceinline__ Sums<A, 2> deviation_sums(
    const A (&V)[ITEMS][VEC], const int (&N)[ITEMS], A m) {
  A sum = A(0);
  A squares = A(0);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A d = k < N[i] ? V[i][k] - m : A(0);
      sum += d;
      squares += d * d;
    }
  }
  return Sums<A, 2>{{sum, squares}};
}
template <int ITEMS, int VEC, typename A>
__device__ __forceinline__ SquareSum<A> square_sum(
    const A (&V)[ITEMS][VEC], const int (&N)[ITEMS]) {
  A sum = A(0);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sum += k < N[i] ? V[i][k] * V[i][k] : A(0);
    }
  }
  return SquareSum<A>{sum};
}

// What y is formed from: the row's mean (0 for RMSNorm: nothing subtracted) and rstd.
template <typename A>
struct RowNorm {
  A mean;
  A rstd;
};

// m = x0 + sum(x - x0) / cols, the shifted mean (exact for a constant row), from the row's
// shifted sum. Its error is a rounding at the scale of |x0 - mean| (not of the row's spread):
// corrected_norm removes it.
template <typename A>
__device__ __forceinline__ A shifted_mean(const Sums<A, 1>& s, A x0, long long cols) {
  return x0 + quotient(s.v[0], static_cast<A>(cols));
}

// The corrected two-pass, from the row's sums of d = x - m and d^2:
//   res  = sum(d) / cols,  mean = m + res
//   M2   = sum(d^2) - sum(d) * res  (>= 0; NaN stays NaN),  rstd = 1 / sqrt(M2 / cols + eps)
template <typename A>
__device__ __forceinline__ RowNorm<A> corrected_norm(
    const Sums<A, 2>& s, A m, long long cols, A eps) {
  const A n = static_cast<A>(cols);
  const A res = quotient(s.v[0], n);
  A m2 = s.v[1] - s.v[0] * res;
  m2 = m2 < A(0) ? A(0) : m2;
  return RowNorm<A>{m + res, inverse_sqrt(quotient(m2, n) + eps)};
}

// rstd = 1 / sqrt(sum(x^2) / cols + eps) of the row's SquareSum (RMSNorm; mean 0).
template <typename A>
__device__ __forceinline__ RowNorm<A> square_norm(
    const SquareSum<A>& s, long long cols, A eps) {
  return RowNorm<A>{A(0), inverse_sqrt(quotient(s.sum, static_cast<A>(cols)) + eps)};
}

// The mean and rstd of a row whose threads hold all of it in registers (V, N: this thread's
// chunks; cols: the row length, >= 1). CENTRE: two reductions over the registers, no memory
// traffic: the shifted sum gives m, then the deviation sums about m give the corrected mean and
// rstd. Else one reduction of the squares. Every thread of the block calls it (row_combine's
// barriers), dead rows included (with their V zero and N empty); warp: within the row.
template <bool CENTRE, int WARPS, int ITEMS, int VEC, typename A>
__device__ __forceinline__ RowNorm<A> row_norm(
    const A (&V)[ITEMS][VEC], const int (&N)[ITEMS], A x0, long long cols, A eps,
    RowPartials<CENTRE, A, WARPS>& partial, int warp) {
  if constexpr (CENTRE) {
    const Sums<A, 1> s = row_combine<WARPS>(shifted_sum(V, N, x0), partial.shifted, warp);
    const A m = shifted_mean(s, x0, cols);
    const Sums<A, 2> q = row_combine<WARPS>(deviation_sums(V, N, m), partial.deviations, warp);
    return corrected_norm(q, m, cols, eps);
  } else {
    return square_norm(row_combine<WARPS>(square_sum(V, N), partial.squares, warp), cols, eps);
  }
}

// The y of one chunk V (as loaded by load_thread_chunks: x itself, or h) at column c, n of its
// columns in the row, in A, into Y: CENTRE, y = (v - mean) * rstd * w + b, v - mean rounded
// once; else y = v * rstd * w (B and mean unused). w = 1 when W is nullptr, b = 0 when B is
// nullptr; w = offset + W, added in A and rounded once there, when offset is not 0 (no addition
// at 0: a weight of -0 keeps its sign). Y may be V. Every kernel forms y here, so a quantizing
// kernel's y is bitwise the plain kernel's before its rounding to T.
template <bool CENTRE, bool VECTOR, int VEC, typename P, typename A>
__device__ __forceinline__ void chunk_y(
    const P* __restrict__ W, const P* __restrict__ B, const A (&V)[VEC], int n, long long c,
    A mean, A rstd, A offset, A (&Y)[VEC]) {
  A w[VEC];
  load_chunk<VECTOR>(W, c, W != nullptr ? n : 0, A(1), w);
  if (offset != A(0)) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      w[k] = w[k] + offset;
    }
  }
  if constexpr (CENTRE) {
    A b[VEC];
    load_chunk<VECTOR>(B, c, B != nullptr ? n : 0, A(0), b);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      Y[k] = (V[k] - mean) * rstd * w[k] + b[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      Y[k] = V[k] * rstd * w[k];
    }
  }
}

// Writes one thread's chunks V to the row Y: chunk_y's y rounded to T.
template <bool CENTRE, bool VECTOR, int ITEMS, int VEC, typename T, typename P, typename A>
__device__ __forceinline__ void write_chunks(
    T* Y, const P* __restrict__ W, const P* __restrict__ B, const A (&V)[ITEMS][VEC],
    const int (&N)[ITEMS], long long first, long long step, A mean, A rstd, A offset) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const long long c = first + i * step;
    A y[VEC];
    chunk_y<CENTRE, VECTOR>(W, B, V[i], N[i], c, mean, rstd, offset, y);
    store_chunk<VECTOR>(Y, c, N[i], y);
  }
}

// The mean and rstd of a row too long for registers (the loop kernels: one block of
// LOOP_THREADS per row), read in steps of SWEEP columns: load(base, V, N) loads this thread's
// LOOP_ITEMS chunks of the step starting at column base (x, or h = x + r). CENTRE: the shifted
// sum (x0 the row's first value) sweeps from the first step up, the deviation sums from the
// last step down; else the squares, from the first up. The steps are those of `last`, the first
// column of the last step. Every thread of the block calls it.
template <bool CENTRE, int WARPS, int VEC, typename A, typename Load>
__device__ __forceinline__ RowNorm<A> swept_norm(
    Load load, A x0, long long last, long long sweep, long long cols, A eps,
    RowPartials<CENTRE, A, WARPS>& partial, int warp) {
  if constexpr (CENTRE) {
    Sums<A, 1> shifted{};  // the empty set
    for (long long base = 0; base <= last; base += sweep) {
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      shifted = combine(shifted, shifted_sum(v, n, x0));
    }
    const A m = shifted_mean(row_combine<WARPS>(shifted, partial.shifted, warp), x0, cols);
    Sums<A, 2> deviations{};
    for (long long base = last; base >= 0; base -= sweep) {
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      deviations = combine(deviations, deviation_sums(v, n, m));
    }
    return corrected_norm(row_combine<WARPS>(deviations, partial.deviations, warp), m, cols, eps);
  } else {
    SquareSum<A> squares{};
    for (long long base = 0; base <= last; base += sweep) {
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      squares = combine(squares, square_sum(v, n));
    }
    return square_norm(row_combine<WARPS>(squares, partial.squares, warp), cols, eps);
  }
}

}  // namespace normlab
