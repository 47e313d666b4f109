// Steps 3 and 4: register tiles, then 16-byte loads.
//
// Step 3 (matmul_register): 256 threads compute a 128 x 128 tile of C, each an 8 x 8 block of it in
// registers. For every k, a thread reads 8 values of the A tile and 8 of the B tile from shared
// memory and does 64 fused multiply-adds with them: 4 flops per shared load instead of step 2's one.
// A thread's rows are ty, ty + 16, ... and its columns tx, tx + 16, ...: the 16 threads of a
// half-warp read 16 neighbouring words of the B tile (no bank conflict) and all read the same word
// of the A tile (a broadcast).
//
// Step 4 (matmul_vectorized): the same, but the tiles are loaded from memory 16 bytes (8 elements)
// per instruction where the rows allow it, and 32 deep along K, so a thread issues 4 loads per
// tile instead of 4 one-element loads per 8 of K. Transposed operands or rows that are not 16-byte
// aligned take the element-by-element path of row_pack: slower, still right.
#include "matmul_tiles.cuh"

constexpr int REG_BM = 128, REG_BN = 128;  // tile of C per block
constexpr int REG_THREADS = 256;            // 16 x 16 threads
constexpr int REG_T = 8;                    // each thread 8 x 8 outputs: 64 accumulators
constexpr int REG_STRIDE = REG_BM / REG_T;  // 16: the distance between a thread's rows (and columns)

// The A tile is stored transposed (k, m) so that a thread's 8 values for one k are in one row.
template <int BK>
__device__ __forceinline__ void accumulate_tile(const float (&a_tile)[BK][REG_BM],
                                                const float (&b_tile)[BK][REG_BN],
                                                float (&acc)[REG_T][REG_T], int tx, int ty) {
#pragma unroll
    for (int k = 0; k < BK; ++k) {
        float a_col[REG_T], b_row[REG_T];
#pragma unroll
        for (int i = 0; i < REG_T; ++i) a_col[i] = a_tile[k][ty + REG_STRIDE * i];
#pragma unroll
        for (int j = 0; j < REG_T; ++j) b_row[j] = b_tile[k][tx + REG_STRIDE * j];
#pragma unroll
        for (int i = 0; i < REG_T; ++i)
#pragma unroll
            for (int j = 0; j < REG_T; ++j) acc[i][j] += a_col[i] * b_row[j];
    }
}

// One element per load (step 3): BK = 8, 1024 elements of each tile, 4 per thread. For A, 8
// neighbouring threads read one row's 8 values of k; for B, neighbouring threads read neighbouring n.
template <typename T, int BK>
__device__ __forceinline__ void load_tiles_scalar(const T* a, const T* b, float (&a_tile)[BK][REG_BM],
                                                  float (&b_tile)[BK][REG_BN], int m0, int n0, int k0,
                                                  int M, int N, int K, int sam, int sak, int sbk,
                                                  int sbn) {
#pragma unroll
    for (int e = threadIdx.x; e < BK * REG_BM; e += REG_THREADS) {
        const int row = e / BK, k = e % BK;
        a_tile[k][row] = element_or_zero(a, m0 + row, k0 + k, M, K, sam, sak);
    }
#pragma unroll
    for (int e = threadIdx.x; e < BK * REG_BN; e += REG_THREADS) {
        const int k = e / REG_BN, col = e % REG_BN;
        b_tile[k][col] = element_or_zero(b, k0 + k, n0 + col, K, N, sbk, sbn);
    }
}

// 16 bytes per load (step 4): BK = 32, 512 packs of 8 in each tile, 2 per thread.
template <typename T, int BK>
__device__ __forceinline__ void load_tiles_packed(const T* a, const T* b, float (&a_tile)[BK][REG_BM],
                                                  float (&b_tile)[BK][REG_BN], int m0, int n0, int k0,
                                                  int M, int N, int K, int sam, int sak, int sbk,
                                                  int sbn, bool vec_a, bool vec_b) {
    constexpr int A_PACKS_PER_ROW = BK / 8, B_PACKS_PER_ROW = REG_BN / 8;
#pragma unroll
    for (int p = threadIdx.x; p < REG_BM * A_PACKS_PER_ROW; p += REG_THREADS) {
        const int row = p / A_PACKS_PER_ROW, k = (p % A_PACKS_PER_ROW) * 8;
        Pack16<T> pack = row_pack(a, m0 + row, k0 + k, M, K, sam, sak, vec_a);
#pragma unroll
        for (int i = 0; i < 8; ++i) a_tile[k + i][row] = to_float(pack[i]);
    }
#pragma unroll
    for (int p = threadIdx.x; p < BK * B_PACKS_PER_ROW; p += REG_THREADS) {
        const int k = p / B_PACKS_PER_ROW, col = (p % B_PACKS_PER_ROW) * 8;
        Pack16<T> pack = row_pack(b, k0 + k, n0 + col, K, N, sbk, sbn, vec_b);
#pragma unroll
        for (int i = 0; i < 8; ++i) b_tile[k][col + i] = to_float(pack[i]);
    }
}

template <typename T, int BK, bool PACKED>
__device__ __forceinline__ void matmul_register_tiles(const T* __restrict__ a, const T* __restrict__ b,
                                                      T* __restrict__ c, int M, int N, int K, int sam,
                                                      int sak, int sbk, int sbn, int ldc, int vec_a,
                                                      int vec_b) {
    __shared__ float a_tile[BK][REG_BM];
    __shared__ float b_tile[BK][REG_BN];
    int tile_m, tile_n;
    grouped_tile((M + REG_BM - 1) / REG_BM, (N + REG_BN - 1) / REG_BN, tile_m, tile_n);
    const int m0 = tile_m * REG_BM, n0 = tile_n * REG_BN;
    const int tx = threadIdx.x % REG_STRIDE, ty = threadIdx.x / REG_STRIDE;
    float acc[REG_T][REG_T] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        if constexpr (PACKED)
            load_tiles_packed<T, BK>(a, b, a_tile, b_tile, m0, n0, k0, M, N, K, sam, sak, sbk, sbn,
                                     vec_a, vec_b);
        else
            load_tiles_scalar<T, BK>(a, b, a_tile, b_tile, m0, n0, k0, M, N, K, sam, sak, sbk, sbn);
        __syncthreads();
        accumulate_tile<BK>(a_tile, b_tile, acc, tx, ty);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < REG_T; ++i) {
        const int m = m0 + ty + REG_STRIDE * i;
#pragma unroll
        for (int j = 0; j < REG_T; ++j) {
            const int n = n0 + tx + REG_STRIDE * j;
            if (m < M && n < N) c[m * ldc + n] = from_float<T>(acc[i][j]);
        }
    }
}

template <typename T>
__device__ __forceinline__ void matmul_register(const T* a, const T* b, T* c, int M, int N, int K,
                                                int sam, int sak, int sbk, int sbn, int ldc,
                                                int vec_a, int vec_b) {
    matmul_register_tiles<T, 8, false>(a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);
}

template <typename T>
__device__ __forceinline__ void matmul_vectorized(const T* a, const T* b, T* c, int M, int N, int K,
                                                  int sam, int sak, int sbk, int sbn, int ldc,
                                                  int vec_a, int vec_b) {
    matmul_register_tiles<T, 32, true>(a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);
}

MATMUL_ENTRIES(matmul_register, REG_THREADS)
MATMUL_ENTRIES(matmul_vectorized, REG_THREADS)
