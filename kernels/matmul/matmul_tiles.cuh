// What every CUDA C matmul step shares: which tile of C a block computes, and how an element or a
// 16-byte pack of an operand is read with its strides and bounds.
//
// Operands are addressed as p[row * s_row + col * s_col]: a transposed operand is the same buffer
// with its strides swapped, so every kernel takes any layout. Offsets fit int32 (the wrapper checks).
#pragma once
#include "elementwise.cuh"

// Blocks are launched in grouped order: GROUP tile rows of C are swept column by column, so the
// blocks running at the same time share GROUP tiles of A and a few of B, and find them in L2.
constexpr int GROUP_M = 8;

// Tile `id` in that order (a block that computes several tiles asks for each of them).
__device__ __forceinline__ void grouped_tile(int tiles_m, int tiles_n, int id, int& tile_m,
                                             int& tile_n) {
    const int per_group = GROUP_M * tiles_n;
    const int first_m = (id / per_group) * GROUP_M;
    const int rows = min(tiles_m - first_m, GROUP_M);
    tile_m = first_m + (id % per_group) % rows;
    tile_n = (id % per_group) / rows;
}
__device__ __forceinline__ void grouped_tile(int tiles_m, int tiles_n, int& tile_m, int& tile_n) {
    grouped_tile(tiles_m, tiles_n, blockIdx.x, tile_m, tile_n);
}

// One element as float, 0 outside the matrix (a zero adds nothing to a dot product, so tails of K
// need no special case in the inner loop).
template <typename T>
__device__ __forceinline__ float element_or_zero(const T* p, int row, int col, int rows, int cols,
                                                 int s_row, int s_col) {
    return (row < rows && col < cols) ? to_float(p[row * s_row + col * s_col]) : 0.0f;
}

// Elements (row, col .. col + 7), zeros outside. One 16-byte load when `vec` (unit column stride,
// 16-byte aligned rows: the wrapper decides) and the whole pack is inside; else one by one.
template <typename T>
__device__ __forceinline__ Pack16<T> row_pack(const T* p, int row, int col, int rows, int cols,
                                              int s_row, int s_col, bool vec) {
    static_assert(Pack16<T>::N == 8, "16-bit types only");
    Pack16<T> pack;
    if (vec && row < rows && col + 8 <= cols) {
        pack.raw = *reinterpret_cast<const uint4*>(p + row * s_row + col);
        return pack;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
        pack[i] = (row < rows && col + i < cols) ? p[row * s_row + (col + i) * s_col] : from_float<T>(0.0f);
    return pack;
}

// extern "C" entry points name_f16 and name_bf16 of the kernel template `name`<T>, for blocks of
// `threads`. Every step takes the same arguments, so one wrapper launches them all: C = A @ B with
// A (M, K) at strides (sam, sak), B (K, N) at (sbk, sbn), C row-major with row stride ldc; vec_a and
// vec_b say whether 16-byte loads along a row of A / B are allowed (steps 1-3 load one element at a
// time and ignore them).
#define MATMUL_ENTRY(name, suffix, T, threads)                                                         \
    extern "C" __global__ void __launch_bounds__(threads)                                              \
        name##_##suffix(const T* a, const T* b, T* c, int M, int N, int K, int sam, int sak, int sbk, \
                        int sbn, int ldc, int vec_a, int vec_b) {                                     \
        name<T>(a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);                             \
    }
#define MATMUL_ENTRIES(name, threads) \
    MATMUL_ENTRY(name, f16, __half, threads) MATMUL_ENTRY(name, bf16, __nv_bfloat16, threads)
