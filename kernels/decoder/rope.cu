// RoPE in CUDA C: each token's heads rotated by its position, the half-split pairs (j, j + D/2) of
// Hugging Face's Llama. One block per token; its threads walk the (head, pair) grid of the token, so
// the angles of a pair are computed once per head and the two halves are loaded and stored as
// consecutive elements (coalesced across the warp).
//
//   theta_j = position * inv_freq[j]            (float32, one rounding: what Hugging Face computes)
//   y[j] = x[j] cos - x[j + D/2] sin,   y[j + D/2] = x[j + D/2] cos + x[j] sin      (in float32)
//
// Positions are read from device memory (int32 or int64), so prefill and decode share the kernel and a
// CUDA graph replays it with new positions. x and y may be the same buffer (in place) and may be
// strided over tokens and heads (a slice of a fused qkv row).
//
// sincosf would bring its slow path for huge arguments (the Payne-Hanek reduction, with a table in
// local memory: a 32-byte stack frame). Instead theta is reduced to [-pi, pi] in double precision
// (exact to ~1e-16 relative for any float theta), where the hardware's __sincosf is accurate to
// 2^-21.4 absolute (CUDA C Programming Guide, intrinsic functions): about 3 ulp of float32 at 1, far
// below one ulp of bf16 or fp16.
#include "elementwise.cuh"

template <typename P>
__device__ __forceinline__ void angle(const P* __restrict__ positions, const float* __restrict__ inv_freq,
                                      int token, int j, float scale, float& c, float& s) {
    const float theta = static_cast<float>(positions[token]) * inv_freq[j];
    const double two_pi = 6.283185307179586;
    const float r = static_cast<float>(theta - two_pi * rint(theta / two_pi));
    __sincosf(r, &s, &c);
    c *= scale;
    s *= scale;
}

template <typename T, typename P>
__device__ void rope(const T* __restrict__ x, T* __restrict__ y, const P* __restrict__ positions,
                     const float* __restrict__ inv_freq, int heads, int half, long long stride_xt,
                     long long stride_xh, long long stride_yt, long long stride_yh, float scale) {
    const int token = blockIdx.x;
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        const int h = idx / half, j = idx % half;
        float c, s;
        angle(positions, inv_freq, token, j, scale, c, s);
        const T* src = x + token * stride_xt + h * stride_xh;
        T* dst = y + token * stride_yt + h * stride_yh;
        const float x1 = to_float(src[j]), x2 = to_float(src[j + half]);
        // every thread reads its pair before writing it: in place is safe (no other thread touches it)
        dst[j] = from_float<T>(x1 * c - x2 * s);
        dst[j + half] = from_float<T>(x2 * c + x1 * s);
    }
}

#define ROPE_KERNEL(NAME, T, P)                                                                       \
    extern "C" __global__ void NAME(const T* x, T* y, const P* positions, const float* inv_freq,      \
                                    int heads, int half, long long stride_xt, long long stride_xh,    \
                                    long long stride_yt, long long stride_yh, float scale) {          \
        rope<T, P>(x, y, positions, inv_freq, heads, half, stride_xt, stride_xh, stride_yt, stride_yh, \
                   scale);                                                                            \
    }

ROPE_KERNEL(rope_f32_i32, float, int)
ROPE_KERNEL(rope_f16_i32, __half, int)
ROPE_KERNEL(rope_bf16_i32, __nv_bfloat16, int)
ROPE_KERNEL(rope_f32_i64, float, long long)
ROPE_KERNEL(rope_f16_i64, __half, long long)
ROPE_KERNEL(rope_bf16_i64, __nv_bfloat16, long long)
