// LayerNorm and RMSNorm forward over the rows of a 2-D array (unit column stride, any signed row
// stride). CENTRE = true, LayerNorm, the corrected two-pass (forward.cuh), in the accumulation
// type A:
//
//   x0   = x[0]                          the row's first element (the shift)
//   m    = x0 + sum(x - x0) / n          first reduction: the shifted mean, exact for a constant
//                                        row but rounded at the scale of |x0 - mean|
//   d    = x - m                         formed from the registers, rounded once
//   res  = sum(d) / n                    second reduction (of d and d^2, over the registers: no
//                                        memory traffic): the correction, at the row's spread
//   mean = m + res                       the corrected mean (written to Mean)
//   M2   = sum(d^2) - sum(d) * res       var = M2 / n, population (ddof = 0); M2 < 0 gives 0
//   rstd = 1 / sqrt(M2 / n + eps)        eps added in A; quotient() and inverse_sqrt()
//                                        (reduce.cuh) within an ulp of IEEE / and sqrt
//   y    = (x - mean) * rstd * w + b     x converted to A, x - mean rounded once; w = 1 without
//                                        weight, b = 0 without bias; rounded once to T
//
// The registers hold x itself; x - x0 and d are formed from them on the fly in the two
// reductions, x - mean in the store. A constant row gives sum(x - x0) = 0, m = x0, d = 0,
// res = 0, mean = x0 exactly, x - mean = 0 and y = b exactly (eps > 0). Each reduction adds a
// thread's values in chunk order and merges the threads in lane, then warp order (reduce.cuh).
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
// row reads, is read before the row's reductions and written after them. W and B never alias Y.
//
// Two kernels, both templates over the element type T, the parameter type P (T, or float when T
// is a half type) and CENTRE:
//   normalize_rows  THREADS threads per row (a warp, with several rows per block, up to a block
//                   per row); each thread keeps ITEMS chunks of the row (x, unshifted) in
//                   registers, so x is read from memory exactly once.
//   normalize_loop  one block of LOOP_THREADS per row, for rows beyond register capacity: x is
//                   read again for each reduction and for y. LayerNorm: three sweeps, the
//                   shifted sum (first chunk group first), the deviation sums (last first) and
//                   y (first first), each starting where the last ended (most likely still in
//                   L2); RMSNorm: two, the squares (first first) and y (last first).
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
    typename Accumulator<T>::type eps,         // added before the square root
    typename Accumulator<T>::type offset) {    // the weight is used as offset + W (0: W)
  using A = typename Accumulator<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int ROWS_PER_BLOCK = RowsBlock<THREADS>::threads / THREADS;
  constexpr int WARPS = THREADS / 32;
  __shared__ RowPartials<CENTRE, A, WARPS> partial[ROWS_PER_BLOCK];
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
    A v[ITEMS][VEC];
    int n[ITEMS];
    load_thread_chunks<VECTOR>(x, first, STEP, live ? cols : 0, v, n);
    const RowNorm<A> s = row_norm<CENTRE, WARPS>(v, n, x0, cols, eps, partial[sub], t / 32);
    if (!live) {
      continue;
    }
    if (CENTRE && t == 0 && Mean != nullptr) {  // flat tests: nested ones cost registers
      Mean[row] = s.mean;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = s.rstd;
    }
    T* y = Y + row * y_row_stride;
    write_chunks<CENTRE, VECTOR>(y, W, B, v, n, first, STEP, s.mean, s.rstd, offset);
  }
}

// One row per block of LOOP_THREADS threads, any row length: each reduction sweeps the row in
// steps of LOOP_THREADS * LOOP_ITEMS chunks, a thread adding its sum of each step to its total,
// then y is written in a last sweep; each sweep reads x again. Arguments as for normalize_rows.
// Grid: any size; blocks stride over the rows.
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
    typename Accumulator<T>::type eps,         // added before the square root
    typename Accumulator<T>::type offset) {    // the weight is used as offset + W (0: W)
  using A = typename Accumulator<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int WARPS = LOOP_THREADS / 32;
  constexpr long long STEP = static_cast<long long>(LOOP_THREADS) * VEC;
  constexpr long long SWEEP = STEP * LOOP_ITEMS;  // columns per step
  __shared__ RowPartials<CENTRE, A, WARPS> partial;
  const int t = static_cast<int>(threadIdx.x);
  const long long first = static_cast<long long>(t) * VEC;
  const long long last = (cols - 1) / SWEEP * SWEEP;  // first column of the last step
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = X + row * x_row_stride;
    const auto load = [&](long long base, A (&v)[LOOP_ITEMS][VEC], int (&n)[LOOP_ITEMS]) {
      load_thread_chunks<VECTOR>(x, base + first, STEP, cols, v, n);
    };
    const A x0 = CENTRE ? to_acc(x[0]) : A(0);
    const RowNorm<A> s =
        swept_norm<CENTRE, WARPS, VEC>(load, x0, last, SWEEP, cols, eps, partial, t / 32);
    if (CENTRE && t == 0 && Mean != nullptr) {  // flat tests: nested ones cost registers
      Mean[row] = s.mean;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = s.rstd;
    }
    T* y = Y + row * y_row_stride;
    for (long long step = 0; step <= last; step += SWEEP) {  // from where the last sweep ended
      const long long base = CENTRE ? step : last - step;
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      write_chunks<CENTRE, VECTOR>(y, W, B, v, n, base + first, STEP, s.mean, s.rstd, offset);
    }
  }
}

}  // namespace normlab
