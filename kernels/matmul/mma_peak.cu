// The ceiling of mma.sync on this GPU: back-to-back m16n8k16 instructions on registers, nothing
// read from or written to memory until the end. What a matmul built on the instruction can reach
// at best, to set beside cuBLAS (wgmma on Hopper) in the benchmark's `mma-variants` section.
#include "matmul_mma.cuh"

// Independent accumulators a warp: each instruction waits for its own chain's last result, so
// several chains in flight keep the tensor cores busy, as a matmul's 16-32 of them do.
constexpr int PEAK_CHAINS = 8;
constexpr int PEAK_THREADS = 256;

template <typename T>
__device__ __forceinline__ void mma_peak(float* out, int iters) {
    // Operands of small nonzero values (1 + a lane-dependent few ulps in both 16-bit formats'
    // low bits); what they are does not matter to the rate, only that they are not constants
    // the compiler could fold.
    const unsigned one = is_bf16<T> ? 0x3f803f80u : 0x3c003c00u;
    const unsigned a[4] = {one ^ (threadIdx.x & 7), one, one ^ (threadIdx.x & 3), one};
    const unsigned b0 = one ^ (threadIdx.x & 1), b1 = one;
    float acc[PEAK_CHAINS][4] = {};
    for (int i = 0; i < iters; ++i)
#pragma unroll
        for (int chain = 0; chain < PEAK_CHAINS; ++chain) mma_16x8x16<T>(acc[chain], a, b0, b1);
    float sum = 0.0f;
#pragma unroll
    for (int chain = 0; chain < PEAK_CHAINS; ++chain)
        sum += acc[chain][0] + acc[chain][1] + acc[chain][2] + acc[chain][3];
    out[blockIdx.x * PEAK_THREADS + threadIdx.x] = sum;  // the results are used: no dead code
}

extern "C" __global__ void __launch_bounds__(PEAK_THREADS) mma_peak_f16(float* out, int iters) {
    mma_peak<__half>(out, iters);
}
extern "C" __global__ void __launch_bounds__(PEAK_THREADS) mma_peak_bf16(float* out, int iters) {
    mma_peak<__nv_bfloat16>(out, iters);
}
