// Fused residual add + LayerNorm / RMSNorm over the rows of 2-D arrays (unit column stride, any
// signed row stride): per row
//
//   h = x + r                            rounded to T: added in A, rounded once (rounded_sum)
//   y = the forward of layer_norm.cu applied to h (forward.cuh: same shift, statistics, rstd,
//       y; CENTRE = true LayerNorm, false RMSNorm), so y and the statistics are bitwise those
//       of normalize_rows / normalize_loop on the rounded h
//   H = h, written only when H is not nullptr (h returned)
//
// A is float for float, half and bfloat16 and double for double. Adding two half or bfloat16
// values in float and rounding once equals their correctly rounded sum (float has more than
// 2p + 2 bits of their p), as NumPy, CuPy and torch add them.
//
// Aliasing: Y may be the memory of X or R; H that of R or X (never Y's); R may be X. Every thread
// reads its own chunks of x and r before writing them (chunk c of a row goes to one thread, as in
// layer_norm.cu), and x[0] and r[0], which every thread of a LayerNorm row reads, are read before
// the row's reduction and written after it. H is written after the reduction, from x and r read
// again by the thread that owns the chunk (the row-resident kernel keeps only the shifted h in
// registers), then Y.
//
// Two kernels, templates over the element type T, the parameter type P (T, or float when T is a
// half type) and CENTRE, launched as the forward ones (cuda_launch plans both):
//   add_normalize_rows  THREADS threads per row, ITEMS chunks each in registers;
//   add_normalize_loop  one block of LOOP_THREADS per row, any row length: statistics in a
//                       first sweep, h and y written in a second (last chunk group first).
#include "forward.cuh"
#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// h = x + r rounded to T, as an accumulator value (exact: h is a value of T).
template <typename T, typename A>
__device__ __forceinline__ A rounded_sum(A x, A r) {
  return to_acc(from_acc<T>(x + r));
}

// Loads one thread's ITEMS chunks of h = x + r (chunk i at column first + i * step; `cols`
// columns in all) into D, unshifted, and the number of columns of each chunk inside the row into
// N. Columns past the row are `fill` (x0: after the shift they are 0, as in load_thread_chunks).
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void load_sum_chunks(
    const T* X, const T* R, long long first, long long step, long long cols, A fill,
    A (&D)[ITEMS][VEC], int (&N)[ITEMS]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    N[i] = chunk_count<VEC>(first + i * step, cols);
    A r[VEC];
    load_chunk<VECTOR>(X, first + i * step, N[i], fill, D[i]);
    load_chunk<VECTOR>(R, first + i * step, N[i], A(0), r);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      D[i][k] = rounded_sum<T>(D[i][k], r[k]);
    }
  }
}

// D -= x0: the shift of load_thread_chunks (LayerNorm only).
template <int ITEMS, int VEC, typename A>
__device__ __forceinline__ void shift_chunks(A (&D)[ITEMS][VEC], A x0) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      D[i][k] -= x0;
    }
  }
}

// Writes the first N[i] values of each unshifted chunk D[i] (h) to the row H.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void store_chunks(
    T* H, const A (&D)[ITEMS][VEC], const int (&N)[ITEMS], long long first, long long step) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    store_chunk<VECTOR>(H, first + i * step, N[i], D[i]);
  }
}

// Writes h = x + r of one thread's ITEMS chunks to the row H, reading x and r again one chunk at
// a time (chunks that only this thread reads and writes).
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void write_sum_chunks(
    const T* X, const T* R, T* H, const int (&N)[ITEMS], long long first, long long step) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const long long c = first + i * step;
    A h[VEC];
    A r[VEC];
    load_chunk<VECTOR>(X, c, N[i], A(0), h);
    load_chunk<VECTOR>(R, c, N[i], A(0), r);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      h[k] = rounded_sum<T>(h[k], r[k]);
    }
    store_chunk<VECTOR>(H, c, N[i], h);
  }
}

// One row per group of THREADS threads, as normalize_rows (layer_norm.cu), for rows with
// cols <= THREADS * ITEMS * VEC. Grid: any size; blocks stride over the row groups.
template <typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR>
__global__ void __launch_bounds__(RowsBlock<THREADS>::threads, RowsBlock<THREADS>::min_blocks)
add_normalize_rows(
    const T* X,                                // x: row i at X + i * x_row_stride
    const T* R,                                // residual: row i at R + i * r_row_stride
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    T* Y,                                      // y: row i at Y + i * y_row_stride
    T* H,                                      // h: row i at H + i * h_row_stride, or nullptr
    typename Accumulator<T>::type* Mean,       // (rows,) row means of h, or nullptr (CENTRE)
    typename Accumulator<T>::type* Rstd,       // (rows,) rstd, or nullptr
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long r_row_stride,                    // elements between rows of the residual
    long long y_row_stride,                    // elements between rows of y
    long long h_row_stride,                    // elements between rows of h
    typename Accumulator<T>::type eps) {       // added before the square root
  using A = typename Accumulator<T>::type;
  using S = typename RowStatistic<CENTRE, A>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int ROWS_PER_BLOCK = RowsBlock<THREADS>::threads / THREADS;
  constexpr int WARPS = THREADS / 32;
  __shared__ S partial[ROWS_PER_BLOCK][WARPS];
  const int sub = static_cast<int>(threadIdx.x) / THREADS;  // row within the block
  const int t = static_cast<int>(threadIdx.x) % THREADS;    // thread within the row
  const long long first = static_cast<long long>(t) * VEC;  // first column of chunk 0
  constexpr long long STEP = static_cast<long long>(THREADS) * VEC;
  const long long groups = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
    const long long row = g * ROWS_PER_BLOCK + sub;
    const bool live = row < rows;
    const long long i = live ? row : 0;
    const T* x = X + i * x_row_stride;
    const T* r = R + i * r_row_stride;
    const A x0 = CENTRE && live ? rounded_sum<T>(to_acc(x[0]), to_acc(r[0])) : A(0);
    A d[ITEMS][VEC];
    int n[ITEMS];
    load_sum_chunks<VECTOR>(x, r, first, STEP, live ? cols : 0, x0, d, n);
    if constexpr (CENTRE) {
      shift_chunks(d, x0);
    }
    const S m = row_combine<WARPS>(thread_statistic<CENTRE>(d, n), partial[sub], t / 32);
    if (!live) {
      continue;
    }
    const A rstd = row_rstd(m, cols, eps);
    const A mean_d = row_mean_d(m);
    if (CENTRE && t == 0 && Mean != nullptr) {
      Mean[row] = x0 + mean_d;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = rstd;
    }
    if (H != nullptr) {
      write_sum_chunks<VECTOR, ITEMS, VEC, T, A>(x, r, H + row * h_row_stride, n, first, STEP);
    }
    write_chunks<CENTRE, VECTOR>(Y + row * y_row_stride, W, B, d, n, first, STEP, mean_d, rstd);
  }
}

// One row per block of LOOP_THREADS threads, any row length, as normalize_loop: statistics of h
// merged over steps, then h (when H is given) and y written in a second sweep, last step first,
// from x and r read again. Arguments as for add_normalize_rows.
template <typename T, typename P, bool CENTRE, bool VECTOR>
__global__ void __launch_bounds__(LOOP_THREADS, 1) add_normalize_loop(
    const T* X,                                // x: row i at X + i * x_row_stride
    const T* R,                                // residual: row i at R + i * r_row_stride
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    T* Y,                                      // y: row i at Y + i * y_row_stride
    T* H,                                      // h: row i at H + i * h_row_stride, or nullptr
    typename Accumulator<T>::type* Mean,       // (rows,) row means of h, or nullptr (CENTRE)
    typename Accumulator<T>::type* Rstd,       // (rows,) rstd, or nullptr
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long r_row_stride,                    // elements between rows of the residual
    long long y_row_stride,                    // elements between rows of y
    long long h_row_stride,                    // elements between rows of h
    typename Accumulator<T>::type eps) {       // added before the square root
  using A = typename Accumulator<T>::type;
  using S = typename RowStatistic<CENTRE, A>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int WARPS = LOOP_THREADS / 32;
  constexpr long long STEP = static_cast<long long>(LOOP_THREADS) * VEC;
  constexpr long long SWEEP = STEP * LOOP_ITEMS;  // columns per step
  __shared__ S partial[WARPS];
  const int t = static_cast<int>(threadIdx.x);
  const long long first = static_cast<long long>(t) * VEC;
  const long long last = (cols - 1) / SWEEP * SWEEP;  // first column of the last step
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = X + row * x_row_stride;
    const T* r = R + row * r_row_stride;
    const A x0 = CENTRE ? rounded_sum<T>(to_acc(x[0]), to_acc(r[0])) : A(0);
    S m{};  // the empty set
    for (long long base = 0; base < cols; base += SWEEP) {
      A d[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load_sum_chunks<VECTOR>(x, r, base + first, STEP, cols, x0, d, n);
      if constexpr (CENTRE) {
        shift_chunks(d, x0);
      }
      m = combine(m, thread_statistic<CENTRE>(d, n));
    }
    m = row_combine<WARPS>(m, partial, t / 32);
    const A rstd = row_rstd(m, cols, eps);
    const A mean_d = row_mean_d(m);
    if (CENTRE && t == 0 && Mean != nullptr) {
      Mean[row] = x0 + mean_d;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = rstd;
    }
    T* h = H == nullptr ? nullptr : H + row * h_row_stride;
    T* y = Y + row * y_row_stride;
    for (long long base = last; base >= 0; base -= SWEEP) {
      A d[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load_sum_chunks<VECTOR>(x, r, base + first, STEP, cols, x0, d, n);
      if (h != nullptr) {
        store_chunks<VECTOR>(h, d, n, base + first, STEP);
      }
      if constexpr (CENTRE) {
        shift_chunks(d, x0);
      }
      write_chunks<CENTRE, VECTOR>(y, W, B, d, n, base + first, STEP, mean_d, rstd);
    }
  }
}

}  // namespace normlab
