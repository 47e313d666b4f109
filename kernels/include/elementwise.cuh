// Conversions between the storage types the course uses and float, the type all arithmetic is done in.
// Every kernel loads its inputs, converts to float, computes, and rounds once to the output type with
// round-to-nearest-even (the same rounding PyTorch uses), so results match PyTorch bit for bit.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Round a float to T and back: the value a T-typed intermediate would hold.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// 16 bytes: the widest load a thread can issue (LDG.E.128). 4 floats, or 8 halves / bfloat16s.
template <typename T> struct Pack16 {
    static constexpr int N = 16 / sizeof(T);
    uint4 raw;
    __device__ __forceinline__ T& operator[](int i) { return reinterpret_cast<T*>(&raw)[i]; }
};
