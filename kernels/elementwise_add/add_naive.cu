// The first kernel everyone writes: one thread per element.
//
// Thread i of block b handles element b * blockDim.x + i. Neighbouring threads of a warp touch
// neighbouring addresses, so each warp's 32 loads coalesce into a few memory transactions. What this
// kernel does badly: each thread issues 2-4 byte loads (half of what a 16-byte load could move per
// instruction), and every thread does only one element of work, so there is little in flight per thread.
#include "elementwise.cuh"

template <typename T>
__device__ __forceinline__ void add_one_per_thread(const T* __restrict__ a, const T* __restrict__ b,
                                                   T* __restrict__ out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // 64-bit: n may exceed 2^31
    if (i < n) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

extern "C" __global__ void add_naive_f32(const float* a, const float* b, float* out, long long n) {
    add_one_per_thread(a, b, out, n);
}
extern "C" __global__ void add_naive_f16(const __half* a, const __half* b, __half* out, long long n) {
    add_one_per_thread(a, b, out, n);
}
extern "C" __global__ void add_naive_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out,
                                          long long n) {
    add_one_per_thread(a, b, out, n);
}
