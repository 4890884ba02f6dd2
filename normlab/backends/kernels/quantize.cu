// LayerNorm / RMSNorm with quantized outputs (normlab.quantize), plain or fused with a residual
// add, over the rows of 2-D arrays (unit column stride, any signed row stride of x, r and h; q
// C-contiguous): per row
//
//   h     = x + r rounded to T (R given: the fused ops; H written when given), else h = x
//   y     = the forward of h in A (forward.cuh: the row code of layer_norm.cu and add_norm.cu),
//           then float32 (A is double for double: y rounded once to float)
//   scale = static_scale when it is > 0, else max|y| / LIMIT (quantize.cuh; NaN in the row:
//           NaN), written to Scale
//   q     = quantize_value(y, scale, mode) (quantize.cuh), written to Q; y is never written.
//
// The row is laid out as the float32 (for double: float64) kernels lay it out, whatever T is:
// chunks of VEC = 16 / sizeof(A) elements, the float32 (float64) rungs of the planner, the same
// reductions in the same order. So y is bitwise the y of normalize_rows / normalize_loop on x
// converted to float32 (float64) with its parameters: the float32 y normlab's contract quantizes.
// A half-type row is read in chunks of 8 bytes. A row's result depends only on its length,
// dtype and mode: bitwise the same alone or in any batch.
//
// Aliasing: H may be the memory of R or X; Q and Scale alias nothing. Each chunk of h is written
// by the thread that read it, after the row's reductions (as in add_norm.cu).
//
// Two kernels, templates over T, P and CENTRE as the forward's, launched on the forward's rungs:
//   norm_quantize_rows  THREADS threads per row, ITEMS chunks each in registers: x (and r) read
//                       once, h written from the registers, y formed in them, max|y| reduced
//                       from them, then q;
//   norm_quantize_loop  one block of LOOP_THREADS per row, any length: the forward's sweeps,
//                       then (dynamic scale) one sweep for max|y|, then one writing h and q.
#include "forward.cuh"
#include "quantize.cuh"
#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// Loads one thread's ITEMS chunks of h into V: x (load_thread_chunks), or x + r rounded to T
// when R is not nullptr (load_sum_chunks).
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void load_h_chunks(
    const T* X, const T* R, long long first, long long step, long long cols, A (&V)[ITEMS][VEC],
    int (&N)[ITEMS]) {
  if (R != nullptr) {
    load_sum_chunks<VECTOR>(X, R, first, step, cols, V, N);
  } else {
    load_thread_chunks<VECTOR>(X, first, step, cols, V, N);
  }
}

// The first value of a row of h, in A.
template <typename T, typename A = typename Accumulator<T>::type>
__device__ __forceinline__ A first_h(const T* x, const T* r) {
  return r == nullptr ? to_acc(x[0]) : rounded_sum<T>(to_acc(x[0]), to_acc(r[0]));
}

// y of each of this thread's chunks V (h), in place, as float32 values held in A.
template <bool CENTRE, bool VECTOR, int ITEMS, int VEC, typename P, typename A>
__device__ __forceinline__ void form_y(
    const P* __restrict__ W, const P* __restrict__ B, A (&V)[ITEMS][VEC], const int (&N)[ITEMS],
    long long first, long long step, const RowNorm<A>& s, A offset) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    chunk_y<CENTRE, VECTOR>(W, B, V[i], N[i], first + i * step, s.mean, s.rstd, offset, V[i]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      V[i][k] = static_cast<A>(static_cast<float>(V[i][k]));
    }
  }
}

// max|y| of this thread's chunks of y (the first N[i] values of each).
template <int ITEMS, int VEC, typename A>
__device__ __forceinline__ Amax thread_amax(const A (&V)[ITEMS][VEC], const int (&N)[ITEMS]) {
  Amax m{0.0f};
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      m = combine(m, Amax{k < N[i] ? fabsf(static_cast<float>(V[i][k])) : 0.0f});
    }
  }
  return m;
}

// Writes q of this thread's chunks of y to the row Q (one byte per element; VECTOR: one access
// of VEC bytes per chunk).
template <bool VECTOR, int ITEMS, int VEC, typename A>
__device__ __forceinline__ void store_q_chunks(
    unsigned char* Q, const A (&V)[ITEMS][VEC], const int (&N)[ITEMS], long long first,
    long long step, float scale, int mode) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    unsigned char q[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      q[k] = quantize_value(static_cast<float>(V[i][k]), scale, mode);
    }
    const long long c = first + i * step;
    if constexpr (VECTOR) {
      using C = Chunk<unsigned char, VEC>;
      if (N[i] > 0) {
        C raw;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          raw.v[k] = q[k];
        }
        __stwb(reinterpret_cast<typename C::W*>(Q + c), raw.w[0]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (k < N[i]) {
          Q[c + k] = q[k];
        }
      }
    }
  }
}

// The shared-memory slots of one row: the forward's, and one per warp for max|y|.
template <bool CENTRE, typename A, int WARPS>
struct QuantizePartials {
  RowPartials<CENTRE, A, WARPS> norm;
  Amax amax[WARPS];
};

// One row per group of THREADS threads, as normalize_rows (layer_norm.cu), for rows with
// cols <= THREADS * ITEMS * VEC. Grid: any size; blocks stride over the row groups.
template <typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR>
__global__ void __launch_bounds__(RowsBlock<THREADS>::threads, RowsBlock<THREADS>::min_blocks)
norm_quantize_rows(
    const T* X,                                // x: row i at X + i * x_row_stride
    const T* R,                                // residual: row i at R + i * r_row_stride, or
                                               // nullptr (layer_norm, rms_norm: h = x)
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    unsigned char* __restrict__ Q,             // q: (rows, cols) C-contiguous, int8 or e4m3fn
    T* H,                                      // h: row i at H + i * h_row_stride, or nullptr
    float* __restrict__ Scale,                 // (rows,) the rows' scales
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long r_row_stride,                    // elements between rows of the residual
    long long h_row_stride,                    // elements between rows of h
    typename Accumulator<T>::type eps,         // added before the square root
    typename Accumulator<T>::type offset,      // the weight is used as offset + W (0: W)
    float static_scale,                        // every row's scale, or 0: max|y_row| / LIMIT
    int mode) {                                // QUANTIZE_INT8 or QUANTIZE_FP8_E4M3
  using A = typename Accumulator<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(A));
  constexpr int ROWS_PER_BLOCK = RowsBlock<THREADS>::threads / THREADS;
  constexpr int WARPS = THREADS / 32;
  __shared__ QuantizePartials<CENTRE, A, WARPS> partial[ROWS_PER_BLOCK];
  const int sub = static_cast<int>(threadIdx.x) / THREADS;  // row within the block
  const int t = static_cast<int>(threadIdx.x) % THREADS;    // thread within the row
  const long long first = static_cast<long long>(t) * VEC;  // first column of chunk 0
  constexpr long long STEP = static_cast<long long>(THREADS) * VEC;
  const long long groups = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  for (long long g = blockIdx.x; g < groups; g += gridDim.x) {
    const long long row = g * ROWS_PER_BLOCK + sub;
    const bool live = row < rows;
    // Every address is formed from i (row, for a live row; 0, only read, for a dead one): the
    // loop then keeps one row index, not row beside offsets derived from it, which cost the top
    // rungs (at their cap of 128 registers) a spill with NVRTC 13.0 for sm_90.
    const long long i = live ? row : 0;
    const T* x = X + i * x_row_stride;
    const T* r = R == nullptr ? nullptr : R + i * r_row_stride;
    const A x0 = CENTRE && live ? first_h(x, r) : A(0);
    A v[ITEMS][VEC];
    int n[ITEMS];
    load_h_chunks<VECTOR>(x, r, first, STEP, live ? cols : 0, v, n);
    const RowNorm<A> s = row_norm<CENTRE, WARPS>(v, n, x0, cols, eps, partial[sub].norm, t / 32);
    if (live && H != nullptr) {
      store_chunks<VECTOR>(H + i * h_row_stride, v, n, first, STEP);
    }
    form_y<CENTRE, VECTOR>(W, B, v, n, first, STEP, s, offset);
    float scale = static_scale;
    if (static_scale == 0.0f) {  // the same for every thread of the block
      const Amax m = row_combine<WARPS>(thread_amax(v, n), partial[sub].amax, t / 32);
      scale = dynamic_scale(m, mode);
    }
    if (!live) {
      continue;
    }
    if (t == 0) {
      Scale[i] = scale;
    }
    store_q_chunks<VECTOR>(Q + i * cols, v, n, first, STEP, scale, mode);
  }
}

// One row per block of LOOP_THREADS threads, any row length, as normalize_loop: the forward's
// sweeps of h for its statistics, a sweep forming y for max|y| (dynamic scale), then a last one
// writing h (when H is given) and q, each reading x (and r) again. Arguments as for
// norm_quantize_rows.
template <typename T, typename P, bool CENTRE, bool VECTOR>
__global__ void __launch_bounds__(LOOP_THREADS, 1) norm_quantize_loop(
    const T* X,                                // x: row i at X + i * x_row_stride
    const T* R,                                // residual, or nullptr (h = x)
    const P* __restrict__ W,                   // weight, (cols,), or nullptr (all ones)
    const P* __restrict__ B,                   // bias, (cols,), or nullptr (all zeros; CENTRE)
    unsigned char* __restrict__ Q,             // q: (rows, cols) C-contiguous
    T* H,                                      // h: row i at H + i * h_row_stride, or nullptr
    float* __restrict__ Scale,                 // (rows,) the rows' scales
    long long rows,                            // number of rows (>= 1)
    long long cols,                            // row length (>= 1)
    long long x_row_stride,                    // elements between rows of x (any sign)
    long long r_row_stride,                    // elements between rows of the residual
    long long h_row_stride,                    // elements between rows of h
    typename Accumulator<T>::type eps,         // added before the square root
    typename Accumulator<T>::type offset,      // the weight is used as offset + W (0: W)
    float static_scale,                        // every row's scale, or 0: max|y_row| / LIMIT
    int mode) {                                // QUANTIZE_INT8 or QUANTIZE_FP8_E4M3
  using A = typename Accumulator<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(A));
  constexpr int WARPS = LOOP_THREADS / 32;
  constexpr long long STEP = static_cast<long long>(LOOP_THREADS) * VEC;
  constexpr long long SWEEP = STEP * LOOP_ITEMS;  // columns per step
  __shared__ QuantizePartials<CENTRE, A, WARPS> partial;
  const int t = static_cast<int>(threadIdx.x);
  const long long first = static_cast<long long>(t) * VEC;
  const long long last = (cols - 1) / SWEEP * SWEEP;  // first column of the last step
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = X + row * x_row_stride;
    const T* r = R == nullptr ? nullptr : R + row * r_row_stride;
    const auto load = [&](long long base, A (&v)[LOOP_ITEMS][VEC], int (&n)[LOOP_ITEMS]) {
      load_h_chunks<VECTOR>(x, r, base + first, STEP, cols, v, n);
    };
    const A x0 = CENTRE ? first_h(x, r) : A(0);
    const RowNorm<A> s =
        swept_norm<CENTRE, WARPS, VEC>(load, x0, last, SWEEP, cols, eps, partial.norm, t / 32);
    // sweeps alternate in direction, each starting where the last ended (most likely in L2)
    bool up = CENTRE;
    float scale = static_scale;
    if (static_scale == 0.0f) {
      Amax m{0.0f};
      for (long long step = 0; step <= last; step += SWEEP) {
        const long long base = up ? step : last - step;
        A v[LOOP_ITEMS][VEC];
        int n[LOOP_ITEMS];
        load(base, v, n);
        form_y<CENTRE, VECTOR>(W, B, v, n, base + first, STEP, s, offset);
        m = combine(m, thread_amax(v, n));
      }
      scale = dynamic_scale(row_combine<WARPS>(m, partial.amax, t / 32), mode);
      up = !up;
    }
    if (t == 0) {
      Scale[row] = scale;
    }
    T* h = H == nullptr ? nullptr : H + row * h_row_stride;
    for (long long step = 0; step <= last; step += SWEEP) {
      const long long base = up ? step : last - step;
      A v[LOOP_ITEMS][VEC];
      int n[LOOP_ITEMS];
      load(base, v, n);
      if (h != nullptr) {
        store_chunks<VECTOR>(h, v, n, base + first, STEP);
      }
      form_y<CENTRE, VECTOR>(W, B, v, n, base + first, STEP, s, offset);
      store_q_chunks<VECTOR>(Q + row * cols, v, n, base + first, STEP, scale, mode);
    }
  }
}

}  // namespace normlab
