// Sums with a chosen accumulator type (float, __half, __nv_bfloat16) and algorithm, one block per
// (chunk, row). Arithmetic is done in float and rounded to the accumulator type after every operation
// (round_to<A>), which is the correctly rounded fp16/bf16 operation: low precision made explicit.
//
//   naive:    each thread adds its elements one after another, then the block adds the threads' sums
//             in a tree (warp shuffles, then the warps' sums);
//   pairwise: each block adds its tile as a balanced binary tree (a thread's 8 adjacent elements, then
//             adjacent threads, then adjacent warps);
//   kahan:    the naive order, each thread carrying a compensation; threads and blocks combined with an
//             exact two-sum so the compensations survive.
//
// Block b works on chunk b % chunks of row b / chunks (a 1-D grid: no limit on rows).
// A launch with one chunk per row writes the row's sum; otherwise block (chunk, row) writes its partial
// sum at out[row][chunk] and, for Kahan, minus its compensation at out[row][chunks + chunk]; the next
// launch sums those.
#include "elementwise.cuh"

constexpr int THREADS = 256;
constexpr int UNROLL = 8;   // independent loads in flight per thread per trip
constexpr int TRIPS = 16;   // naive/kahan: a block reads THREADS * UNROLL * TRIPS = 32768 elements
constexpr unsigned FULL = 0xffffffffu;

enum Algo { NAIVE = 0, PAIRWISE = 1, KAHAN = 2 };

// A sum and its compensation; the value represented is s - c.
struct SC {
    float s, c;
};

template <typename A, int ALGO>
__device__ __forceinline__ SC combine(SC a, SC b) {
    if (ALGO != KAHAN) return {round_to<A>(a.s + b.s), 0.f};
    // Knuth's two-sum: a.s + b.s == t + e exactly, whatever their magnitudes.
    const float t = round_to<A>(a.s + b.s);
    const float b_virtual = round_to<A>(t - a.s);
    const float e = round_to<A>(round_to<A>(a.s - round_to<A>(t - b_virtual)) + round_to<A>(b.s - b_virtual));
    return {t, round_to<A>(round_to<A>(a.c + b.c) - e)};
}

template <typename A, int ALGO>
__device__ SC block_combine(SC v) {
    __shared__ SC warp_sums[THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // lane i meets lane i ^ offset: neighbours first, so the tree adds adjacent partial sums
    for (int offset = 1; offset < 32; offset *= 2) {
        const SC other = {__shfl_xor_sync(FULL, v.s, offset), __shfl_xor_sync(FULL, v.c, offset)};
        v = (lane & offset) ? combine<A, ALGO>(other, v) : combine<A, ALGO>(v, other);
    }
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < THREADS / 32 ? warp_sums[lane] : SC{0.f, 0.f};
        for (int offset = 1; offset < THREADS / 32; offset *= 2) {
            const SC other = {__shfl_xor_sync(FULL, v.s, offset), __shfl_xor_sync(FULL, v.c, offset)};
            v = (lane & offset) ? combine<A, ALGO>(other, v) : combine<A, ALGO>(v, other);
        }
    }
    return v;  // valid in thread 0
}

template <typename T, typename A, int ALGO>
__device__ void sum_chunk(const T* __restrict__ x, float* __restrict__ out, long long n, long long x_row_stride,
                          long long out_row_stride, int chunks) {
    const int chunk = blockIdx.x % chunks;
    const long long row = blockIdx.x / chunks;
    const T* xr = x + row * x_row_stride;
    SC acc = {0.f, 0.f};
    if (ALGO == PAIRWISE) {
        // this thread's UNROLL adjacent elements of the block's tile, added as a tree
        const long long first = (long long)chunk * THREADS * UNROLL + (long long)threadIdx.x * UNROLL;
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = first + u < n ? round_to<A>(to_float(xr[first + u])) : 0.f;
#pragma unroll
        for (int width = UNROLL / 2; width > 0; width /= 2)
#pragma unroll
            for (int u = 0; u < width; ++u) v[u] = round_to<A>(v[2 * u] + v[2 * u + 1]);
        acc.s = v[0];
    } else {
        const long long start = (long long)chunk * THREADS * UNROLL * TRIPS + threadIdx.x;
        for (int trip = 0; trip < TRIPS; ++trip) {
            float v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {  // all loads first: UNROLL of them in flight
                const long long i = start + (long long)(trip * UNROLL + u) * THREADS;
                v[u] = i < n ? round_to<A>(to_float(xr[i])) : 0.f;
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (ALGO == KAHAN) {
                    const float y = round_to<A>(v[u] - acc.c);
                    const float t = round_to<A>(acc.s + y);
                    acc.c = round_to<A>(round_to<A>(t - acc.s) - y);
                    acc.s = t;
                } else {
                    acc.s = round_to<A>(acc.s + v[u]);
                }
            }
        }
    }
    acc = block_combine<A, ALGO>(acc);
    if (threadIdx.x == 0) {
        float* o = out + row * out_row_stride;
        if (chunks == 1) {
            o[0] = round_to<A>(acc.s - acc.c);
        } else {
            o[chunk] = acc.s;
            if (ALGO == KAHAN) o[chunks + chunk] = -acc.c;
        }
    }
}

#define SUM_KERNEL(ALGO_NAME, ALGO, T_NAME, T, A_NAME, A)                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS) sum_##ALGO_NAME##_##T_NAME##_##A_NAME(             \
        const T* x, float* out, long long n, long long x_row_stride, long long out_row_stride, int chunks) { \
        sum_chunk<T, A, ALGO>(x, out, n, x_row_stride, out_row_stride, chunks);                             \
    }

#define SUM_KERNELS_FOR_INPUT(T_NAME, T)                                  \
    SUM_KERNEL(naive, NAIVE, T_NAME, T, f32, float)                       \
    SUM_KERNEL(naive, NAIVE, T_NAME, T, f16, __half)                      \
    SUM_KERNEL(naive, NAIVE, T_NAME, T, bf16, __nv_bfloat16)              \
    SUM_KERNEL(pairwise, PAIRWISE, T_NAME, T, f32, float)                 \
    SUM_KERNEL(pairwise, PAIRWISE, T_NAME, T, f16, __half)                \
    SUM_KERNEL(pairwise, PAIRWISE, T_NAME, T, bf16, __nv_bfloat16)        \
    SUM_KERNEL(kahan, KAHAN, T_NAME, T, f32, float)                       \
    SUM_KERNEL(kahan, KAHAN, T_NAME, T, f16, __half)                      \
    SUM_KERNEL(kahan, KAHAN, T_NAME, T, bf16, __nv_bfloat16)

SUM_KERNELS_FOR_INPUT(f32, float)
SUM_KERNELS_FOR_INPUT(f16, __half)
SUM_KERNELS_FOR_INPUT(bf16, __nv_bfloat16)
