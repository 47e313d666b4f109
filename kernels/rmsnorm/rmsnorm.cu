// RMSNorm forward in CUDA C: y = x * rsqrt(mean(x^2) + eps) * w, one row at a time.
//
// The pattern every row reduction follows:
// 1. Each thread loads its slice of the row into registers (16-byte vector loads where the row allows),
//    so the row is read from global memory exactly once, however many passes the math needs.
// 2. Each thread squares and sums its slice in float32; a warp adds its 32 partial sums with shuffles
//    (no shared memory, no barrier); a block adds its warps' sums through shared memory.
// 3. Every thread scales its slice, still in registers, and stores it.
//
// Two shapes of the same idea:
// * warp per row (narrow rows, up to 32 * 4 packs): 8 rows per 256-thread block, a warp reduction only;
// * block per row (wide rows): up to 512 threads per row, warp then shared-memory reduction.
// ITEMS is how many packs each thread keeps in registers (a compile-time constant, so the array stays in
// registers: a run-time index would send it to local memory). ITEMS = 0 is the fallback for rows too
// wide for registers: it reads the row twice (the second read mostly hits L2).
// V is the pack width: 16 bytes when the row's width and stride allow it, else 1 element.
#include "elementwise.cuh"

template <typename T, int V>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, float (&out)[V]) {
    if constexpr (V * sizeof(T) == 16) {
        Pack16<T> pack{*reinterpret_cast<const uint4*>(p)};
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = to_float(pack[k]);
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) out[k] = to_float(p[k]);
    }
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const float (&in)[V]) {
    if constexpr (V * sizeof(T) == 16) {
        Pack16<T> pack;
#pragma unroll
        for (int k = 0; k < V; ++k) pack[k] = from_float<T>(in[k]);
        *reinterpret_cast<uint4*>(p) = pack.raw;
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) p[k] = from_float<T>(in[k]);
    }
}

// The second half of every variant: y = x * rstd * w for one pack of the row (v holds x as floats).
template <typename T, int V>
__device__ __forceinline__ void scale_pack(const float (&v)[V], const T* __restrict__ w, T* __restrict__ y,
                                           float rstd) {
    float wv[V], out[V];
    load_pack<T, V>(w, wv);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = v[k] * rstd * wv[k];
    store_pack<T, V>(y, out);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;  // every lane holds the sum
}

__device__ __forceinline__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    v = warp_sum(v);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.f;  // every warp re-reduces the partials:
    return warp_sum(v);                                 // no second barrier, no broadcast needed
}

template <typename T, int V, int ITEMS, bool WARP_PER_ROW>
__device__ __forceinline__ void rmsnorm_rows(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                             long long rows, int width, long long x_stride, long long y_stride,
                                             float eps) {
    const int lanes = WARP_PER_ROW ? 32 : blockDim.x;
    const int lane = WARP_PER_ROW ? threadIdx.x % 32 : threadIdx.x;
    const long long row = WARP_PER_ROW ? (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32
                                       : (long long)blockIdx.x;
    if (row >= rows) return;  // whole warps only (warp per row); block per row launches exactly `rows` blocks
    const T* xr = x + row * x_stride;
    T* yr = y + row * y_stride;
    float sum_sq = 0.f;
    if constexpr (ITEMS > 0) {
        float v[ITEMS][V];
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int col = (i * lanes + lane) * V;  // consecutive lanes, consecutive packs: coalesced
            if (col < width) {
                load_pack<T, V>(xr + col, v[i]);
#pragma unroll
                for (int k = 0; k < V; ++k) sum_sq += v[i][k] * v[i][k];
            }
        }
        sum_sq = WARP_PER_ROW ? warp_sum(sum_sq) : block_sum(sum_sq);
        const float rstd = rsqrtf(sum_sq / width + eps);
        // w is loaded after the reduction. Loading it with x (to hide its latency behind the barrier)
        // doubled the registers held across the reduction and measured slower on an H200: 84% of copy
        // instead of 95% at 32768 x 4096 bf16 (kernels/rmsnorm/PERFORMANCE.md).
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int col = (i * lanes + lane) * V;
            if (col < width) scale_pack<T, V>(v[i], w + col, yr + col, rstd);
        }
    } else {
        for (int col = lane * V; col < width; col += lanes * V) {
            float v[V];
            load_pack<T, V>(xr + col, v);
#pragma unroll
            for (int k = 0; k < V; ++k) sum_sq += v[k] * v[k];
        }
        sum_sq = WARP_PER_ROW ? warp_sum(sum_sq) : block_sum(sum_sq);
        const float rstd = rsqrtf(sum_sq / width + eps);
        for (int col = lane * V; col < width; col += lanes * V) {
            float v[V];
            load_pack<T, V>(xr + col, v);  // the second read of the row, mostly from L2
            scale_pack<T, V>(v, w + col, yr + col, rstd);
        }
    }
}

// Staged in shared memory: for rows so wide that a register-resident slice needs 512 threads per row,
// which leaves one or two rows in flight per SM, each stalling at its barrier with nothing to overlap.
// Here 256 threads copy the row into shared memory as they sum its squares, then scale it from there:
// still one read of the row from global memory, few registers, and as many rows in flight per SM as
// shared memory holds (7 rows of 16384 bf16 in an H200's 227 KB). Each thread reads back only the packs
// it wrote, so the block barrier inside the reduction is the only one needed.
template <typename T, int V, int UNROLL>
__device__ __forceinline__ void rmsnorm_row_staged(const T* __restrict__ x, const T* __restrict__ w,
                                                   T* __restrict__ y, int width, long long x_stride,
                                                   long long y_stride, float eps) {
    extern __shared__ __align__(16) unsigned char staged_bytes[];
    T* staged = reinterpret_cast<T*>(staged_bytes);
    const T* xr = x + (long long)blockIdx.x * x_stride;
    T* yr = y + (long long)blockIdx.x * y_stride;
    float sum_sq = 0.f;
#pragma unroll UNROLL
    for (int col = threadIdx.x * V; col < width; col += blockDim.x * V) {
        float v[V];
        load_pack<T, V>(xr + col, v);
        store_pack<T, V>(staged + col, v);  // exact: v holds T values, converted back without rounding
#pragma unroll
        for (int k = 0; k < V; ++k) sum_sq += v[k] * v[k];
    }
    const float rstd = rsqrtf(block_sum(sum_sq) / width + eps);
#pragma unroll UNROLL
    for (int col = threadIdx.x * V; col < width; col += blockDim.x * V) {
        float v[V];
        load_pack<T, V>(staged + col, v);
        scale_pack<T, V>(v, w + col, yr + col, rstd);
    }
}

// extern "C" entry points, named rmsnorm_{warp,block}_{f32,f16,bf16}_{v,s}{ITEMS}: v = 16-byte packs,
// s = scalar; ITEMS 1, 2, 4 (4 packs of the row per thread: at most 56 registers for sm_90, so 512
// threads fit the 64K-register file); ITEMS 0 = two-pass fallback (block per row only) for wider rows;
// rmsnorm_staged_{f32,f16,bf16}_{v,s}{4,8}: a block per row, staged in `width` elements of dynamic shared
// memory, 4 or 8 packs per thread in flight per pass.
#define RMSNORM_KERNEL(kind, warp_per_row, suffix, T, vec, V, items)                                         \
    extern "C" __global__ void rmsnorm_##kind##_##suffix##_##vec##items(                                    \
        const T* x, const T* w, T* y, long long rows, int width, long long x_stride, long long y_stride,    \
        float eps) {                                                                                         \
        rmsnorm_rows<T, V, items, warp_per_row>(x, w, y, rows, width, x_stride, y_stride, eps);             \
    }
#define RMSNORM_ITEMS(kind, warp_per_row, suffix, T, vec, V)  \
    RMSNORM_KERNEL(kind, warp_per_row, suffix, T, vec, V, 1)  \
    RMSNORM_KERNEL(kind, warp_per_row, suffix, T, vec, V, 2)  \
    RMSNORM_KERNEL(kind, warp_per_row, suffix, T, vec, V, 4)
#define RMSNORM_DTYPE(suffix, T)                                   \
    RMSNORM_ITEMS(warp, true, suffix, T, v, (16 / sizeof(T)))      \
    RMSNORM_ITEMS(warp, true, suffix, T, s, 1)                     \
    RMSNORM_ITEMS(block, false, suffix, T, v, (16 / sizeof(T)))    \
    RMSNORM_ITEMS(block, false, suffix, T, s, 1)                   \
    RMSNORM_KERNEL(block, false, suffix, T, v, (16 / sizeof(T)), 0) \
    RMSNORM_KERNEL(block, false, suffix, T, s, 1, 0)

#define RMSNORM_STAGED(suffix, T, vec, V, unroll)                                                            \
    extern "C" __global__ void rmsnorm_staged_##suffix##_##vec##unroll(                                       \
        const T* x, const T* w, T* y, int width, long long x_stride, long long y_stride, float eps) {          \
        rmsnorm_row_staged<T, V, unroll>(x, w, y, width, x_stride, y_stride, eps);                           \
    }
#define RMSNORM_STAGED_UNROLLS(suffix, T, vec, V) \
    RMSNORM_STAGED(suffix, T, vec, V, 4)          \
    RMSNORM_STAGED(suffix, T, vec, V, 8)
RMSNORM_STAGED_UNROLLS(f32, float, v, 4)
RMSNORM_STAGED_UNROLLS(f32, float, s, 1)
RMSNORM_STAGED_UNROLLS(f16, __half, v, 8)
RMSNORM_STAGED_UNROLLS(f16, __half, s, 1)
RMSNORM_STAGED_UNROLLS(bf16, __nv_bfloat16, v, 8)
RMSNORM_STAGED_UNROLLS(bf16, __nv_bfloat16, s, 1)

RMSNORM_DTYPE(f32, float)
RMSNORM_DTYPE(f16, __half)
RMSNORM_DTYPE(bf16, __nv_bfloat16)
