// LayerNorm and RMSNorm forward over the rows of a 2-D array (unit column stride, any signed row
// stride). CENTRE = true, LayerNorm:
//
//   x0   = x[0]                          the row's first element (the shift)
//   d    = x - x0                        in the accumulation type A
//   mean = x0 + mean(d)
//   var  = mean((d - mean(d))^2)         population variance (ddof = 0), exact two-pass per
//                                        thread, merged across threads with Chan's rule
//   rstd = 1 / sqrt(var + eps)           eps added in A; quotient() and inverse_sqrt()
//                                        (reduce.cuh) within an ulp of IEEE / and sqrt
//   y    = (d - mean(d)) * rstd * w + b  w = 1 without weight, b = 0 without bias; rounded once
//
// CENTRE = false, RMSNorm (no shift, no mean, no bias):
//
//   rstd = 1 / sqrt(mean(x^2) + eps)     squares summed per thread, sums added across threads
//   y    = x * rstd * w                  w = 1 without weight; rounded once
//
// A is float for float, half and bfloat16 and double for double; mean and rstd are written
// in A. A row is cut into chunks of VEC = 16 / sizeof(T) elements; chunk c of a row goes
// to thread c % THREADS of the row's thread group, as its chunk number c / THREADS. The
// assignment and the arithmetic do not depend on VECTOR (16-byte loads and stores, or one
// element at a time), so a row's result depends only on its length and dtype: bitwise the same
// alone, in a batch, aligned or not. X and Y may be the same memory (in place): each element is
// written by the thread that read it, after reading it; x[0], which every thread of a LayerNorm
// row reads, is read before the row's reduction and written after it. W and B never alias Y.
//
// Two kernels, both templates over the element type T, the parameter type P (T, or float when T
// is a half type) and CENTRE:
//   normalize_rows  THREADS threads per row (a warp, with several rows per block, up to a block
//                   per row); each thread keeps ITEMS chunks of the row in registers, so x is
//                   read from memory exactly once.
//   normalize_loop  one block of LOOP_THREADS per row, for rows beyond register capacity: a
//                   sweep that merges statistics chunk group by chunk group, then a second
//                   sweep, last chunk group first (most likely still in L2), that writes y.
#include "forward.cuh"
#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// One row per group of THREADS threads (32 ... 1024), RowsBlock<THREADS>::threads / THREADS
// rows per block, each thread holding ITEMS chunks of its row in registers. Handles rows with
// cols <= THREADS * ITEMS * VEC. Grid: any size; blocks stride over the row groups.
template <typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR>
__global__ void __launch_bounds__(RowsBlock<THREADS>::threads, RowsBlock<THREADS>::min_blocks)
normalize_rows(
    const T* X,                                // x: row r at X + r * x_row_stride
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    T* Y,                                      // y: row r at Y + r * y_row_stride; may be X
    typename Accumulator<T>::type* Mean,       // (rows,) row means, or nullptr (CENTRE)
    typename Accumulator<T>::type* Rstd,       // (rows,) rstd, or nullptr
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long y_row_stride,                    // elements between rows of y (any sign)
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
    const long long r = live ? row : 0;
    const T* x = X + r * x_row_stride;
    const A x0 = CENTRE && live ? to_acc(x[0]) : A(0);
    A d[ITEMS][VEC];
    int n[ITEMS];
    load_thread_chunks<CENTRE, VECTOR>(x, first, STEP, live ? cols : 0, x0, d, n);
    const S m = row_combine<WARPS>(thread_statistic<CENTRE>(d, n), partial[sub], t / 32);
    if (!live) {
      continue;
    }
    const A rstd = row_rstd(m, cols, eps);
    const A mean_d = row_mean_d(m);
    if (CENTRE && t == 0 && Mean != nullptr) {  // flat tests: nested ones cost registers
      Mean[row] = x0 + mean_d;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = rstd;
    }
    write_chunks<CENTRE, VECTOR>(Y + row * y_row_stride, W, B, d, n, first, STEP, mean_d, rstd);
  }
}

// One row per block of LOOP_THREADS threads, any row length: statistics merged over steps of
// LOOP_THREADS * LOOP_ITEMS chunks, then y written in a second sweep (last step first) that
// re-reads x. Arguments as for normalize_rows. Grid: any size; blocks stride over the rows.
template <typename T, typename P, bool CENTRE, bool VECTOR>
__global__ void __launch_bounds__(LOOP_THREADS, 1) normalize_loop(
    const T* X,                                // x: row r at X + r * x_row_stride
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    T* Y,                                      // y: row r at Y + r * y_row_stride; may be X
    typename Accumulator<T>::type* Mean,       // (rows,) row means, or nullptr (CENTRE)
    typename Accumulator<T>::type* Rstd,       // (rows,) rstd, or nullptr
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long y_row_stride,                    // elements between rows of y (any sign)
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
    const A x0 = CENTRE ? to_acc(x[0]) : A(0);
    S m{};  // the empty set
    for (long long base = 0; base < cols; base += SWEEP) {
      A d[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load_thread_chunks<CENTRE, VECTOR>(x, base + first, STEP, cols, x0, d, n);
      m = combine(m, thread_statistic<CENTRE>(d, n));
    }
    m = row_combine<WARPS>(m, partial, t / 32);
    const A rstd = row_rstd(m, cols, eps);
    const A mean_d = row_mean_d(m);
    if (CENTRE && t == 0 && Mean != nullptr) {  // flat tests: nested ones cost registers
      Mean[row] = x0 + mean_d;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = rstd;
    }
    T* y = Y + row * y_row_stride;
    for (long long base = last; base >= 0; base -= SWEEP) {
      A d[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load_thread_chunks<CENTRE, VECTOR>(x, base + first, STEP, cols, x0, d, n);
      write_chunks<CENTRE, VECTOR>(y, W, B, d, n, base + first, STEP, mean_d, rstd);
    }
  }
}

}  // namespace normlab
