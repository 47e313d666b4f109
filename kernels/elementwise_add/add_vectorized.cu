// Element-wise add with 16-byte loads and stores, a grid-stride loop and a scalar tail.
//
// * 16-byte accesses: each thread moves one `uint4` (4 floats or 8 halves) per load instruction, so a
//   warp moves 512 contiguous bytes per instruction instead of 64-128.
// * Grid-stride loop: each thread walks the tensor in steps of the whole grid's width, so the kernel is
//   correct for any grid size and the grid becomes a tuning choice. Measured on an H200
//   (data/results/h200/01_elementwise_add/vectorized-add-variants.md): a persistent grid of 8 blocks per SM reached 94%
//   of copy bandwidth in fp16, a grid that covers the data (one trip per thread) 97%, equal to torch.
//   So the wrapper covers the data by default, and `max_blocks` lets notebook 01 show the difference.
// * Scalar tail: n need not be a multiple of the vector width; the last n % N elements are done one by
//   one. The caller guarantees 16-byte-aligned pointers (it falls back to the naive kernel otherwise).
//
// The same pattern does the fused residual add of a parallel-residual transformer block
// (GPT-NeoX/Pythia: out = x + attn(ln1(x)) + mlp(ln2(x))): three reads and one write in one pass,
// instead of two adds that write and re-read an intermediate.
#include "elementwise.cuh"

template <typename T>
__device__ __forceinline__ void add2(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                                     long long n) {
    constexpr int N = Pack16<T>::N;
    const long long n_vec = n / N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* a16 = reinterpret_cast<const uint4*>(a);
    const uint4* b16 = reinterpret_cast<const uint4*>(b);
    uint4* out16 = reinterpret_cast<uint4*>(out);
    for (long long v = tid; v < n_vec; v += stride) {
        Pack16<T> x{a16[v]}, y{b16[v]}, z;
#pragma unroll
        for (int k = 0; k < N; ++k) z[k] = from_float<T>(to_float(x[k]) + to_float(y[k]));
        out16[v] = z.raw;
    }
    const long long i = n_vec * N + tid;  // tail: fewer than N elements, one per thread
    if (i < n) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

// out = (mlp + attn) + x. With `exact_order`, the intermediate is rounded to T first: that is what
// PyTorch computes for `mlp + attn + x` with T tensors (each op rounds its result), so the fused kernel
// reproduces it bit for bit. Without it, the sum is accumulated in float and rounded once: more
// accurate, but different bits from the unfused model.
template <typename T, bool exact_order>
__device__ __forceinline__ float sum3(float x, float attn, float mlp) {
    float partial = mlp + attn;
    if (exact_order) partial = round_to<T>(partial);
    return partial + x;
}

template <typename T, bool exact_order>
__device__ __forceinline__ void add3(const T* __restrict__ x, const T* __restrict__ attn, const T* __restrict__ mlp,
                                     T* __restrict__ out, long long n) {
    constexpr int N = Pack16<T>::N;
    const long long n_vec = n / N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4* x16 = reinterpret_cast<const uint4*>(x);
    const uint4* attn16 = reinterpret_cast<const uint4*>(attn);
    const uint4* mlp16 = reinterpret_cast<const uint4*>(mlp);
    uint4* out16 = reinterpret_cast<uint4*>(out);
    for (long long v = tid; v < n_vec; v += stride) {
        Pack16<T> p{x16[v]}, q{attn16[v]}, r{mlp16[v]}, z;
#pragma unroll
        for (int k = 0; k < N; ++k)
            z[k] = from_float<T>(sum3<T, exact_order>(to_float(p[k]), to_float(q[k]), to_float(r[k])));
        out16[v] = z.raw;
    }
    const long long i = n_vec * N + tid;
    if (i < n) out[i] = from_float<T>(sum3<T, exact_order>(to_float(x[i]), to_float(attn[i]), to_float(mlp[i])));
}

#define DEFINE_KERNELS(suffix, T)                                                                        \
    extern "C" __global__ void add_vectorized_##suffix(const T* a, const T* b, T* out, long long n) {    \
        add2<T>(a, b, out, n);                                                                           \
    }                                                                                                    \
    extern "C" __global__ void residual_add_exact_##suffix(const T* x, const T* attn, const T* mlp,      \
                                                           T* out, long long n) {                        \
        add3<T, true>(x, attn, mlp, out, n);                                                             \
    }                                                                                                    \
    extern "C" __global__ void residual_add_fp32_##suffix(const T* x, const T* attn, const T* mlp,       \
                                                          T* out, long long n) {                         \
        add3<T, false>(x, attn, mlp, out, n);                                                            \
    }

DEFINE_KERNELS(f32, float)
DEFINE_KERNELS(f16, __half)
DEFINE_KERNELS(bf16, __nv_bfloat16)
