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

#define MMA_PEAK_ENTRY(chains, suffix, T)                                                     \
    extern "C" __global__ void __launch_bounds__(PEAK_THREADS)                                \
        mma_peak_##chains##_##suffix(float* out, int iters) {                                 \
        mma_peak<T, chains>(out, iters);                                                      \
    }
MMA_PEAK_ENTRY(8, f16, __half)
MMA_PEAK_ENTRY(8, bf16, __nv_bfloat16)
MMA_PEAK_ENTRY(32, f16, __half)
MMA_PEAK_ENTRY(32, bf16, __nv_bfloat16)
