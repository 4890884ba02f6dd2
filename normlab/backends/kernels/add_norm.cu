// Fused residual add + LayerNorm / RMSNorm over the rows of 2-D arrays (unit column stride, any
// signed row stride): per row
//
//   h    = x + r                         rounded to T: added in A, rounded once (rounded_sum)
//   y    = the forward of layer_norm.cu applied to h (forward.cuh; CENTRE = true LayerNorm,
//          false RMSNorm), so y and the statistics are bitwise those of normalize_rows /
//          normalize_loop on the rounded h. LayerNorm:
//   h0   = h[0]                          the shift, in A
//   m    = h0 + sum(h - h0) / n          first reduction: the shifted mean
//   d    = h - m                         formed from the registers, rounded once
//   res  = sum(d) / n                    second reduction (of d and d^2, over the registers: no
//                                        memory traffic): the correction, at the row's spread
//   mean = m + res                       the corrected mean (written to Mean)
//   M2   = sum(d^2) - sum(d) * res       var = M2 / n (ddof = 0); M2 < 0 gives 0
//   rstd = 1 / sqrt(M2 / n + eps)
//   y    = (h - mean) * rstd * w + b     h converted to A (exact), h - mean rounded once
//   RMSNorm: rstd = 1 / sqrt(mean(h^2) + eps), y = h * rstd * w (no shift)
//   H    = h, written only when H is not nullptr (h returned)
//
// The registers hold h itself (h - h0 and d are formed from them on the fly in the two
// reductions): y and H are both written from them. A constant row of h gives mean = h0 exactly
// and y = b exactly (eps > 0).
//
// A is float for float, half and bfloat16 and double for double. Adding two half or bfloat16
// values in float and rounding once equals their correctly rounded sum (float has more than
// 2p + 2 bits of their p), as NumPy, CuPy and torch add them.
//
// Aliasing: Y may be the memory of X or R; H that of R or X (never Y's); R may be X. Every thread
// reads its own chunks of x and r before writing them (chunk c of a row goes to one thread, as in
// layer_norm.cu), and x[0] and r[0], which every thread of a LayerNorm row reads, are read before
// the row's reductions and written after them. H is written after the reductions by the thread
// that owns the chunk, from the h in its registers (add_normalize_loop: from x and r read again
// in its last sweep, before that chunk's y), then Y.
//
// Two kernels, templates over the element type T, the parameter type P (T, or float when T is a
// half type) and CENTRE, launched as the forward ones (cuda_launch plans both):
//   add_normalize_rows  THREADS threads per row, ITEMS chunks each in registers;
//   add_normalize_loop  one block of LOOP_THREADS per row, any row length, as normalize_loop:
//                       x and r read again for each reduction (LayerNorm: two sweeps, RMSNorm:
//                       one), then h and y written in a last sweep.
#include "forward.cuh"
#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

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
    const long long i = live ? row : 0;
    const T* x = X + i * x_row_stride;
    const T* r = R + i * r_row_stride;
    const A x0 = CENTRE && live ? rounded_sum<T>(to_acc(x[0]), to_acc(r[0])) : A(0);
    A v[ITEMS][VEC];
    int n[ITEMS];
    load_sum_chunks<VECTOR>(x, r, first, STEP, live ? cols : 0, v, n);
    const RowNorm<A> s = row_norm<CENTRE, WARPS>(v, n, x0, cols, eps, partial[sub], t / 32);
    if (!live) {
      continue;
    }
    if (CENTRE && t == 0 && Mean != nullptr) {
      Mean[row] = s.mean;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = s.rstd;
    }
    if (H != nullptr) {
      store_chunks<VECTOR>(H + row * h_row_stride, v, n, first, STEP);
    }
    T* y = Y + row * y_row_stride;
    write_chunks<CENTRE, VECTOR>(y, W, B, v, n, first, STEP, s.mean, s.rstd, offset);
  }
}

// One row per block of LOOP_THREADS threads, any row length, as normalize_loop: each reduction
// of h sweeps the row in steps, reading x and r again, then h (when H is given) and y are written
// in a last sweep, from x and r read again. Arguments as for add_normalize_rows.
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
    const T* r = R + row * r_row_stride;
    const auto load = [&](long long base, A (&v)[LOOP_ITEMS][VEC], int (&n)[LOOP_ITEMS]) {
      load_sum_chunks<VECTOR>(x, r, base + first, STEP, cols, v, n);
    };
    const A x0 = CENTRE ? rounded_sum<T>(to_acc(x[0]), to_acc(r[0])) : A(0);
    const RowNorm<A> s =
        swept_norm<CENTRE, WARPS, VEC>(load, x0, last, SWEEP, cols, eps, partial, t / 32);
    if (CENTRE && t == 0 && Mean != nullptr) {
      Mean[row] = s.mean;
    }
    if (t == 0 && Rstd != nullptr) {
      Rstd[row] = s.rstd;
    }
    T* h = H == nullptr ? nullptr : H + row * h_row_stride;
    T* y = Y + row * y_row_stride;
    for (long long step = 0; step <= last; step += SWEEP) {  // from where the last sweep ended
      const long long base = CENTRE ? step : last - step;
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      if (h != nullptr) {
        store_chunks<VECTOR>(h, v, n, base + first, STEP);
      }
      write_chunks<CENTRE, VECTOR>(y, W, B, v, n, base + first, STEP, s.mean, s.rstd, offset);
    }
  }
}

}  // namespace normlab
