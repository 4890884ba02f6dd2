// LayerNorm and RMSNorm backward over the rows of 2-D arrays (unit column stride, any signed row
// stride; dy, x and dx each have their own). Per row of n elements, with the mean and rstd the
// forward returned, CENTRE = true, LayerNorm:
//
//   d        = x - mean                        in the accumulation type A
//   res      = mean(d)                         the residual of a rounded mean (0 if exact)
//   x^       = (d - res) * rstd
//   g        = dy * w                          w = 1 without weight
//   mean(g * x^) = rstd * (sum(g * d) - res * sum(g)) / n
//   dx       = rstd * (g - mean(g) - x^ * mean(g * x^))    rounded once to x's dtype
//   dweight  = sum over rows of dy * x^
//   dbias    = sum over rows of dy
//
// CENTRE = false, RMSNorm: d = x, res = 0, no mean(g) term and no dbias.
//
// A is float for float, half and bfloat16 and double for double. The row sums (of d, g and
// g * d) are reduced as the forward's statistics are (reduce.cuh: each thread's exact sums,
// merged in lane and warp order), so dx of a row depends only on its length: bitwise the same
// alone, in a batch, aligned or not.
//
// dweight and dbias are reduced without atomics, in an order fixed by the shape alone (never by
// the grid or the GPU), so that every run gives the same bits:
//   weight_partials  the rows are cut into chunks of ROW_CHUNK rows (shapes.cuh); for each
//                    chunk and column one thread adds the chunk's rows in row order (in A, with
//                    fma) into row `chunk` of a (chunks, cols) workspace
//   sum_chunks       per column, the chunks' partial sums added in a fixed order in double:
//                    chunk k to lane k % SUM_LANES in chunk order, then the lanes in order;
//                    rounded once to A
//
// Four kernels, templates over the element type T, the weight type P (T, or float when T is a
// half type) and CENTRE:
//   backward_rows    THREADS threads per row, each holding ITEMS chunks of d and of g in
//                    registers: x and dy are read once, dx written once; writes res per row
//                    for weight_partials
//   backward_loop    one block of LOOP_THREADS per row, for rows beyond register capacity: a
//                    sweep that adds the row sums, then a second sweep, last chunk group first,
//                    that writes dx
//   weight_partials  as above; x and dy are read a second time (as torch's backward does)
//   sum_chunks       as above
#include "reduce.cuh"
#include "rows.cuh"

namespace normlab {

// Chunks per thread per step of backward_loop (LOOP_THREADS threads per row, shapes.cuh).
constexpr int GRAD_LOOP_ITEMS = 2;

// The row sums a thread adds: sum(d), sum(g), sum(g * d) for LayerNorm; sum(g * d) for RMSNorm.
template <bool CENTRE, typename A>
using GradSums = Sums<A, CENTRE ? 3 : 1>;

// Loads one thread's ITEMS chunks of the rows x and dy (chunk i at column first + i * step;
// `cols` columns in all): D = x - m (0 past the row), G = dy * w (0 past the row; w = 1 when W
// is nullptr, offset + W when offset is not 0, as the forward's write_chunks forms it); N: the
// number of columns of each chunk inside the row.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename P, typename A>
__device__ __forceinline__ void load_grad_chunks(
    const T* X, const T* DY, const P* __restrict__ W, long long first, long long step,
    long long cols, A m, A offset, A (&D)[ITEMS][VEC], A (&G)[ITEMS][VEC], int (&N)[ITEMS]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const long long c = first + i * step;
    N[i] = chunk_count<VEC>(c, cols);
    load_chunk<VECTOR>(X, c, N[i], m, D[i]);  // filled with m: d = 0 past the row
    load_chunk<VECTOR>(DY, c, N[i], A(0), G[i]);
    A w[VEC];
    load_chunk<VECTOR>(W, c, W != nullptr ? N[i] : 0, A(1), w);
    if (offset != A(0)) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        w[k] = w[k] + offset;
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      D[i][k] -= m;
      G[i][k] *= w[k];
    }
  }
}

// The row sums of one thread's chunks (zero past the row, so nothing is masked).
template <bool CENTRE, int ITEMS, int VEC, typename A>
__device__ __forceinline__ GradSums<CENTRE, A> thread_sums(
    const A (&D)[ITEMS][VEC], const A (&G)[ITEMS][VEC]) {
  GradSums<CENTRE, A> s{};
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if constexpr (CENTRE) {
        s.v[0] += D[i][k];
        s.v[1] += G[i][k];
        s.v[2] += G[i][k] * D[i][k];
      } else {
        s.v[0] += G[i][k] * D[i][k];
      }
    }
  }
  return s;
}

// What dx of a row needs from its sums: res, mean(g) and mean(g * x^).
template <typename A>
struct RowTerms {
  A res;
  A mean_g;
  A mean_gx;
};

template <bool CENTRE, typename A>
__device__ __forceinline__ RowTerms<A> row_terms(const GradSums<CENTRE, A>& s, long long cols,
                                                 A rstd) {
  const A n = static_cast<A>(cols);
  if constexpr (CENTRE) {
    const A res = quotient(s.v[0], n);
    return RowTerms<A>{res, quotient(s.v[1], n), rstd * quotient(s.v[2] - res * s.v[1], n)};
  } else {
    return RowTerms<A>{A(0), A(0), rstd * quotient(s.v[0], n)};
  }
}

// Writes dx = rstd * (g - mean(g) - x^ * mean(g * x^)) of one thread's chunks to the row DX.
template <bool VECTOR, int ITEMS, int VEC, typename T, typename A>
__device__ __forceinline__ void write_dx(
    T* DX, const A (&D)[ITEMS][VEC], const A (&G)[ITEMS][VEC], const int (&N)[ITEMS],
    long long first, long long step, const RowTerms<A>& terms, A rstd) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    A dx[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A xhat = (D[i][k] - terms.res) * rstd;
      dx[k] = rstd * (G[i][k] - terms.mean_g - xhat * terms.mean_gx);
    }
    store_chunk<VECTOR>(DX, first + i * step, N[i], dx);
  }
}

// dx of one row per group of THREADS threads (32 ... 512), RowsBlock<THREADS>::threads / THREADS
// rows per block, each thread holding ITEMS chunks of d and of g. Handles rows with
// cols <= THREADS * ITEMS * VEC. Grid: any size; blocks stride over the row groups.
template <typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR>
__global__ void __launch_bounds__(RowsBlock<THREADS>::threads, RowsBlock<THREADS>::min_blocks)
backward_rows(
    const T* DY,                                         // dy: row r at DY + r * dy_row_stride
    const T* X,                                          // x: row r at X + r * x_row_stride
    const typename Accumulator<T>::type* __restrict__ Mean,  // (rows,) forward means (CENTRE)
    const typename Accumulator<T>::type* __restrict__ Rstd,  // (rows,) forward rstd
    const P* __restrict__ W,                             // weight, (cols,), or nullptr (ones)
    T* DX,                                               // dx: row r at DX + r * dx_row_stride,
                                                         // or nullptr (not needed)
    typename Accumulator<T>::type* Res,                  // (rows,) res of each row, or nullptr
    long long rows,                                      // number of rows (>= 1)
    long long cols,                                      // row length (>= 1)
    long long dy_row_stride,                             // elements between rows of dy
    long long x_row_stride,                              // elements between rows of x
    long long dx_row_stride,                             // elements between rows of dx
    typename Accumulator<T>::type offset) {              // the weight is used as offset + W
  using A = typename Accumulator<T>::type;
  using S = GradSums<CENTRE, A>;
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
    const A m = CENTRE && live ? Mean[r] : A(0);
    A d[ITEMS][VEC];
    A gr[ITEMS][VEC];
    int n[ITEMS];
    load_grad_chunks<VECTOR>(X + r * x_row_stride, DY + r * dy_row_stride, W, first, STEP,
                             live ? cols : 0, m, offset, d, gr, n);
    const S s = row_combine<WARPS>(thread_sums<CENTRE>(d, gr), partial[sub], t / 32);
    if (!live) {
      continue;
    }
    const A rstd = Rstd[row];
    const RowTerms<A> terms = row_terms<CENTRE>(s, cols, rstd);
    if (CENTRE && t == 0 && Res != nullptr) {
      Res[row] = terms.res;
    }
    if (DX != nullptr) {
      write_dx<VECTOR>(DX + row * dx_row_stride, d, gr, n, first, STEP, terms, rstd);
    }
  }
}

// dx of one row per block of LOOP_THREADS threads, any row length: the row sums added over
// steps of LOOP_THREADS * GRAD_LOOP_ITEMS chunks, then dx written in a second sweep (last
// step first) that re-reads x and dy. Arguments as for backward_rows. Grid: any size; blocks
// stride over the rows.
template <typename T, typename P, bool CENTRE, bool VECTOR>
__global__ void __launch_bounds__(LOOP_THREADS, 1) backward_loop(
    const T* DY,                                         // dy: row r at DY + r * dy_row_stride
    const T* X,                                          // x: row r at X + r * x_row_stride
    const typename Accumulator<T>::type* __restrict__ Mean,  // (rows,) forward means (CENTRE)
    const typename Accumulator<T>::type* __restrict__ Rstd,  // (rows,) forward rstd
    const P* __restrict__ W,                             // weight, (cols,), or nullptr (ones)
    T* DX,                                               // dx: row r at DX + r * dx_row_stride,
                                                         // or nullptr (not needed)
    typename Accumulator<T>::type* Res,                  // (rows,) res of each row, or nullptr
    long long rows,                                      // number of rows (>= 1)
    long long cols,                                      // row length (>= 1)
    long long dy_row_stride,                             // elements between rows of dy
    long long x_row_stride,                              // elements between rows of x
    long long dx_row_stride,                             // elements between rows of dx
    typename Accumulator<T>::type offset) {              // the weight is used as offset + W
  using A = typename Accumulator<T>::type;
  using S = GradSums<CENTRE, A>;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int WARPS = LOOP_THREADS / 32;
  constexpr long long STEP = static_cast<long long>(LOOP_THREADS) * VEC;
  constexpr long long SWEEP = STEP * GRAD_LOOP_ITEMS;  // columns per step
  __shared__ S partial[WARPS];
  const int t = static_cast<int>(threadIdx.x);
  const long long first = static_cast<long long>(t) * VEC;
  const long long last = (cols - 1) / SWEEP * SWEEP;  // first column of the last step
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = X + row * x_row_stride;
    const T* dy = DY + row * dy_row_stride;
    const A m = CENTRE ? Mean[row] : A(0);
    S s{};  // the empty set
    for (long long base = 0; base < cols; base += SWEEP) {
      A d[GRAD_LOOP_ITEMS][VEC];
      A gr[GRAD_LOOP_ITEMS][VEC];
      int n[GRAD_LOOP_ITEMS];
      load_grad_chunks<VECTOR>(x, dy, W, base + first, STEP, cols, m, offset, d, gr, n);
      s = combine(s, thread_sums<CENTRE>(d, gr));
    }
    s = row_combine<WARPS>(s, partial, t / 32);
    const A rstd = Rstd[row];
    const RowTerms<A> terms = row_terms<CENTRE>(s, cols, rstd);
    if (CENTRE && t == 0 && Res != nullptr) {
      Res[row] = terms.res;
    }
    if (DX == nullptr) {
      continue;
    }
    T* dx = DX + row * dx_row_stride;
    for (long long base = last; base >= 0; base -= SWEEP) {
      A d[GRAD_LOOP_ITEMS][VEC];
      A gr[GRAD_LOOP_ITEMS][VEC];
      int n[GRAD_LOOP_ITEMS];
      load_grad_chunks<VECTOR>(x, dy, W, base + first, STEP, cols, m, offset, d, gr, n);
      write_dx<VECTOR>(dx, d, gr, n, base + first, STEP, terms, rstd);
    }
  }
}

// The partial sums of dweight (dy * x^) and dbias (dy) of each chunk of ROW_CHUNK rows: block b
// takes chunk b / tiles and the tile b % tiles of PARTIAL_THREADS * VEC columns; each thread one
// 16-byte chunk of columns, adding the chunk's rows in row order. Grid: any size; blocks stride
// over the (chunk, tile) pairs.
template <typename T, bool CENTRE, bool VECTOR>
__global__ void __launch_bounds__(PARTIAL_THREADS) weight_partials(
    const T* DY,                                         // dy: row r at DY + r * dy_row_stride
    const T* X,                                          // x: row r at X + r * x_row_stride
    const typename Accumulator<T>::type* __restrict__ Mean,  // (rows,) forward means (CENTRE)
    const typename Accumulator<T>::type* __restrict__ Res,   // (rows,) res (CENTRE), from
                                                         // backward_rows or backward_loop
    const typename Accumulator<T>::type* __restrict__ Rstd,  // (rows,) forward rstd
    typename Accumulator<T>::type* WParts,               // (chunks, cols): sums of dy * x^,
                                                         // or nullptr (dweight not needed)
    typename Accumulator<T>::type* BParts,               // (chunks, cols): sums of dy, or
                                                         // nullptr (dbias not needed)
    long long rows,                                      // number of rows (>= 1)
    long long cols,                                      // row length (>= 1)
    long long dy_row_stride,                             // elements between rows of dy
    long long x_row_stride) {                            // elements between rows of x
  using A = typename Accumulator<T>::type;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr long long TILE = static_cast<long long>(PARTIAL_THREADS) * VEC;
  const long long tiles = (cols + TILE - 1) / TILE;
  const long long chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
  for (long long b = blockIdx.x; b < chunks * tiles; b += gridDim.x) {
    const long long chunk = b / tiles;
    const long long c = b % tiles * TILE + static_cast<long long>(threadIdx.x) * VEC;
    const int n = chunk_count<VEC>(c, cols);
    if (n == 0) {
      continue;  // no barrier in this kernel: threads may leave early
    }
    A sw[VEC];
    A sb[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sw[k] = A(0);
      sb[k] = A(0);
    }
    const long long end = rows < (chunk + 1) * ROW_CHUNK ? rows : (chunk + 1) * ROW_CHUNK;
#pragma unroll 4
    for (long long r = chunk * ROW_CHUNK; r < end; ++r) {
      A dy[VEC];
      load_chunk<VECTOR>(DY + r * dy_row_stride, c, n, A(0), dy);
      if (WParts != nullptr) {
        const A m = CENTRE ? Mean[r] : A(0);
        const A res = CENTRE ? Res[r] : A(0);
        const A rstd = Rstd[r];
        A x[VEC];
        load_chunk<VECTOR>(X + r * x_row_stride, c, n, A(0), x);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          sw[k] = fma(dy[k], (x[k] - m - res) * rstd, sw[k]);  // fma: the same bits everywhere
        }
      }
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        sb[k] += dy[k];
      }
    }
    if (WParts != nullptr) {
      store_chunk<VECTOR>(WParts + chunk * cols, c, n, sw);
    }
    if (BParts != nullptr) {
      store_chunk<VECTOR>(BParts + chunk * cols, c, n, sb);
    }
  }
}

// out[j] = the sum over chunks k of Parts[k, j], for dweight (blockIdx.y 0) and dbias
// (blockIdx.y 1): thread (lane, column) adds chunks lane, lane + SUM_LANES, ... in order, in
// double; then lane 0 adds the SUM_LANES sums in lane order and rounds once to A. Grid:
// (any, 1 or 2); blocks stride over the tiles of SUM_COLUMNS columns.
template <typename A>
__global__ void __launch_bounds__(SUM_COLUMNS * SUM_LANES) sum_chunks(
    const A* WParts,     // (chunks, cols) partial sums of dweight, or nullptr
    const A* BParts,     // (chunks, cols) partial sums of dbias, or nullptr
    A* DW,               // (cols,) dweight, written when WParts is given
    A* DB,               // (cols,) dbias, written when BParts is given
    long long chunks,    // number of chunks (>= 1)
    long long cols) {    // row length (>= 1)
  __shared__ double partial[SUM_LANES][SUM_COLUMNS + 1];
  const A* Parts = blockIdx.y == 0 ? WParts : BParts;
  A* Out = blockIdx.y == 0 ? DW : DB;
  if (Parts == nullptr) {
    return;  // the same for the whole block: no thread waits at a barrier
  }
  const int column = static_cast<int>(threadIdx.x) % SUM_COLUMNS;
  const int lane = static_cast<int>(threadIdx.x) / SUM_COLUMNS;
  const long long tiles = (cols + SUM_COLUMNS - 1) / SUM_COLUMNS;
  for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const long long c = tile * SUM_COLUMNS + column;
    double total = 0.0;
    if (c < cols) {
      for (long long k = lane; k < chunks; k += SUM_LANES) {
        total += static_cast<double>(Parts[k * cols + c]);
      }
    }
    partial[lane][column] = total;
    __syncthreads();
    if (lane == 0 && c < cols) {
      double sum = 0.0;
#pragma unroll
      for (int j = 0; j < SUM_LANES; ++j) {
        sum += partial[j][column];
      }
      Out[c] = static_cast<A>(sum);
    }
    __syncthreads();
  }
}

}  // namespace normlab
