// Step 2: shared-memory tiles.
//
// A block of 32 x 32 threads computes a 32 x 32 tile of C. For each step of 32 along K it copies a
// 32 x 32 tile of A and one of B into shared memory (one element per thread), waits, and every
// thread reads its row of the A tile and its column of the B tile from there. Each element loaded
// from memory is used 32 times: 16x fewer global loads than step 1. The limit is now shared memory:
// two shared loads per fused multiply-add.
#include "matmul_tiles.cuh"

constexpr int TILE = 32;

template <typename T>
__device__ __forceinline__ void matmul_shared(const T* __restrict__ a, const T* __restrict__ b,
                                              T* __restrict__ c, int M, int N, int K, int sam,
                                              int sak, int sbk, int sbn, int ldc, int, int) {
    // Stored as float: converted once when loaded, not 32 times when read.
    __shared__ float a_tile[TILE][TILE];
    __shared__ float b_tile[TILE][TILE];
    int tile_m, tile_n;
    grouped_tile((M + TILE - 1) / TILE, (N + TILE - 1) / TILE, tile_m, tile_n);
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE;
    const int m = tile_m * TILE + ty, n = tile_n * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Zeros past M, N or K: the tails need no other care.
        a_tile[ty][tx] = element_or_zero(a, m, k0 + tx, M, K, sam, sak);
        b_tile[ty][tx] = element_or_zero(b, k0 + ty, n, K, N, sbk, sbn);
        __syncthreads();  // the tiles are complete before anyone reads them
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += a_tile[ty][k] * b_tile[k][tx];
        __syncthreads();  // everyone is done reading before the next tiles overwrite them
    }
    if (m < M && n < N) c[m * ldc + n] = from_float<T>(acc);
}

MATMUL_ENTRIES(matmul_shared, TILE * TILE)
