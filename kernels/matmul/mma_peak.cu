// The ceiling of mma.sync on this GPU: back-to-back m16n8k16 instructions on registers, nothing
// read from or written to memory until the end. What a matmul built on the instruction can reach
// at best, to set beside cuBLAS (wgmma on Hopper) in the benchmark's `mma-variants` section.
#include "matmul_mma.cuh"

// CHAINS independent accumulators a warp: each instruction waits for its own chain's last
// result, so several chains in flight keep the tensor cores busy. 8 chains with many warps an SM
// give the instruction's rate; 32 chains is what one of step 5's 64 x 64 warps has (4 x 8 tiles).
constexpr int PEAK_THREADS = 256;

template <typename T, int CHAINS>
__device__ __forceinline__ void mma_peak(float* out, int iters) {
    // Operands of small nonzero values (1 + a lane-dependent few ulps in both 16-bit formats'
    // low bits); what they are does not matter to the rate, only that they are not constants
    // the compiler could fold.
    const unsigned one = is_bf16<T> ? 0x3f803f80u : 0x3c003c00u;
    const unsigned a[4] = {one ^ (threadIdx.x & 7), one, one ^ (threadIdx.x & 3), one};
    const unsigned b0 = one ^ (threadIdx.x & 1), b1 = one;
    float acc[CHAINS][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int chain = 0; chain < CHAINS; ++chain) mma_16x8x16<T>(acc[chain], a, b0, b1);
    float sum = 0.0f;
#pragma unroll
    for (int chain = 0; chain < CHAINS; ++chain)
        sum += acc[chain][0] + acc[chain][1] + acc[chain][2] + acc[chain][3];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = sum;  // the results are used: no dead code
}

// The same count of instructions as one of step 5's 64 x 64 warps issues per 16 of K, with its
// operands: 4 fragments of A and 8 of B, each product on its own pair (a[i], b[j]) in step 5's
// order. Against mma_peak<T, 32>, whose instructions all read the same operands, it says whether
// reading different registers for each instruction costs the tensor cores anything.
template <typename T>
__device__ __forceinline__ void mma_peak_warp_tile(float* out, int iters) {
    const unsigned one = is_bf16<T> ? 0x3f803f80u : 0x3c003c00u;
    unsigned a[4][4], b[8][2];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r) a[i][r] = one ^ ((threadIdx.x + i + r) & 7);
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j][0] = one ^ ((threadIdx.x + j) & 3), b[j][1] = one ^ (j & 1);
    float acc[4][8][4] = {};
    for (int it = 0; it < iters; ++it)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int j = i % 2 ? 7 - jj : jj;  // step 5's serpentine order
                mma_16x8x16<T>(acc[i][j], a[i], b[j][0], b[j][1]);
            }
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
            sum += acc[i][j][0] + acc[i][j][1] + acc[i][j][2] + acc[i][j][3];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = sum;
}

#define MMA_PEAK_ENTRY(chains, suffix, T)                                                     \
    extern "C" __global__ void __launch_bounds__(PEAK_THREADS)                                \
        mma_peak_##chains##_##suffix(float* out, int iters) {                                 \
        mma_peak<T, chains>(out, iters);                                                      \
    }
MMA_PEAK_ENTRY(8, f16, __half)
MMA_PEAK_ENTRY(8, bf16, __nv_bfloat16)
MMA_PEAK_ENTRY(32, f16, __half)
MMA_PEAK_ENTRY(32, bf16, __nv_bfloat16)
#define MMA_PEAK_WARP_TILE_ENTRY(suffix, T)                                                   \
    extern "C" __global__ void __launch_bounds__(PEAK_THREADS)                                \
        mma_peak_warp_tile_##suffix(float* out, int iters) {                                  \
        mma_peak_warp_tile<T>(out, iters);                                                    \
    }
MMA_PEAK_WARP_TILE_ENTRY(f16, __half)
MMA_PEAK_WARP_TILE_ENTRY(bf16, __nv_bfloat16)
