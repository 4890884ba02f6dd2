// The launch shapes the kernels share with the planner (normlab.backends.cuda_launch). Their
// values live in one Python table, normlab.constants, and reach NVRTC as -DNORMLAB_<NAME>=<value>
// options (normlab.backends.cuda_compile.kernel_macros); none is written down here.
#pragma once

#if !defined(NORMLAB_ROW_CHUNK) || !defined(NORMLAB_LOOP_THREADS) ||                  \
    !defined(NORMLAB_LOOP_ITEMS) || !defined(NORMLAB_MIN_BLOCK) ||                    \
    !defined(NORMLAB_PARTIAL_THREADS) || !defined(NORMLAB_SUM_COLUMNS) ||             \
    !defined(NORMLAB_SUM_LANES)
#error "compile with the -D options of normlab.backends.cuda_compile.kernel_macros()"
#endif

namespace normlab {

// Rows per partial sum of dweight and dbias (ROW_CHUNK, as the CPU backends).
constexpr int ROW_CHUNK = NORMLAB_ROW_CHUNK;
// Threads per row of normalize_loop and backward_loop (CUDA_LOOP_THREADS).
constexpr int LOOP_THREADS = NORMLAB_LOOP_THREADS;
// Chunks per thread per step of normalize_loop (CUDA_LOOP_ITEMS).
constexpr int LOOP_ITEMS = NORMLAB_LOOP_ITEMS;
// Fewest threads per block of normalize_rows and backward_rows (CUDA_MIN_BLOCK).
constexpr int MIN_BLOCK = NORMLAB_MIN_BLOCK;
// Threads per block of weight_partials: each takes one 16-byte chunk of columns of a row chunk.
constexpr int PARTIAL_THREADS = NORMLAB_PARTIAL_THREADS;
// sum_chunks: columns per block, and lanes (threads) per column that share out the chunks.
constexpr int SUM_COLUMNS = NORMLAB_SUM_COLUMNS;
constexpr int SUM_LANES = NORMLAB_SUM_LANES;

}  // namespace normlab
