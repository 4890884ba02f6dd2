// How the kernels hold rows: the 16-bit storage types, the accumulation type of each element
// type and the conversions to and from it, a row read and written in chunks (of 16 bytes, or
// of VEC accumulators' width in the quantizing kernels: one access of up to 16 bytes, or element
// by element), and the block shape of the row-resident kernels. Shared by every kernel file.
#pragma once

#include "shapes.cuh"

namespace normlab {

// The two 16-bit float formats, as storage only (the kernels compute in float). Defined here
// rather than taken from cuda_fp16.h / cuda_bf16.h, which NVRTC does not ship.
struct half {  // IEEE 754 binary16
  unsigned short bits;
};
struct bfloat16 {  // bfloat16: the upper 16 bits of a float32
  unsigned short bits;
};

// Accumulation type of element type T.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(half v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_acc(bfloat16 v) {
  return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
}

// Rounds an accumulator value to T, to nearest even.
template <typename T>
__device__ __forceinline__ T from_acc(typename Accumulator<T>::type v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <>
__device__ __forceinline__ half from_acc<half>(float v) {
  half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
  return h;
}
template <>
__device__ __forceinline__ bfloat16 from_acc<bfloat16>(float v) {
  bfloat16 h;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
#else
  const unsigned u = __float_as_uint(v);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const unsigned rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // to nearest even
  h.bits = static_cast<unsigned short>(nan ? (u >> 16) | 0x40u : rounded);  // NaN stays quiet
#endif
  return h;
}

// How many of the VEC columns [c, c + VEC) lie below cols: 0 ... VEC.
template <int VEC>
__device__ __forceinline__ int chunk_count(long long c, long long cols) {
  const long long left = cols - c;
  return left <= 0 ? 0 : left >= VEC ? VEC : static_cast<int>(left);
}

// The unsigned word of BYTES bytes (2, 4, 8 or 16) a chunk is read and written with.
template <int BYTES>
struct Word {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = unsigned int;
};
template <>
struct Word<2> {
  using type = unsigned short;
};

// VEC elements of type E, seen as WORDS words of up to 16 bytes for loads and stores
// (VEC * sizeof(E) is 2, 4, 8 or a multiple of 16). Reading the member not last written is the
// usual CUDA idiom for reusing the bits of a vector access; nvcc and NVRTC define it.
template <typename E, int VEC>
union Chunk {
  static constexpr int BYTES = VEC * static_cast<int>(sizeof(E));
  using W = typename Word<(BYTES < 16 ? BYTES : 16)>::type;
  static constexpr int WORDS = BYTES / static_cast<int>(sizeof(W));
  E v[VEC];
  W w[WORDS];
};

// Reads the first n of the VEC elements Row[c, c + VEC) into V, the rest as `fill`.
// VECTOR: Row + c is aligned to the chunk's size and n is 0 or VEC (the planner guarantees
// both), so the chunk is read with loads of up to 16 bytes.
template <bool VECTOR, int VEC, typename E, typename A>
__device__ __forceinline__ void load_chunk(const E* Row, long long c, int n, A fill, A (&V)[VEC]) {
  if constexpr (VECTOR) {
    using C = Chunk<E, VEC>;
    C raw;
#pragma unroll
    for (int k = 0; k < C::WORDS; ++k) {
      raw.w[k] = n > 0 ? reinterpret_cast<const typename C::W*>(Row + c)[k] : typename C::W{};
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      V[k] = n > 0 ? to_acc(raw.v[k]) : fill;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      V[k] = k < n ? to_acc(Row[c + k]) : fill;
    }
  }
}

// Writes the first n of the VEC values V, rounded to T, to Row[c, c + VEC); VECTOR as for
// load_chunk.
template <bool VECTOR, int VEC, typename T, typename A>
__device__ __forceinline__ void store_chunk(T* Row, long long c, int n, const A (&V)[VEC]) {
  if constexpr (VECTOR) {
    using C = Chunk<T, VEC>;
    if (n > 0) {
      C raw;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        raw.v[k] = from_acc<T>(V[k]);
      }
#pragma unroll
      for (int k = 0; k < C::WORDS; ++k) {
        __stwb(reinterpret_cast<typename C::W*>(Row + c) + k, raw.w[k]);  // never split
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (k < n) {
        Row[c + k] = from_acc<T>(V[k]);
      }
    }
  }
}

// Threads per block of the row-resident kernels, normalize_rows and backward_rows (at least
// MIN_BLOCK, so short rows share a block), and the blocks per SM asked of ptxas: 512 threads, so
// up to 128 registers per thread. Stating it keeps ptxas from trading a few spills for occupancy
// on its own.
template <int THREADS>
struct RowsBlock {
  static constexpr int threads = THREADS < MIN_BLOCK ? MIN_BLOCK : THREADS;
  static constexpr int min_blocks = 512 / threads;
};

}  // namespace normlab
