// Step 1: one thread per output.
//
// Thread (m, n) walks row m of A and column n of B: 2K loads for 2K flops. The 32 threads of a warp
// share m and take 32 neighbouring n, so their loads of B coalesce and their load of A is one
// broadcast; still, every element of A is read N times and every element of B M times, from L2 at
// best. Arithmetic intensity against L2: 2 flops per 2 loads (4 bytes), far below the ridge point.
#include "matmul_tiles.cuh"

constexpr int NAIVE_N = 32;  // a warp along n
constexpr int NAIVE_M = 8;   // 8 warps along m: 256 threads

template <typename T>
__device__ __forceinline__ void matmul_naive(const T* __restrict__ a, const T* __restrict__ b,
                                             T* __restrict__ c, int M, int N, int K, int sam,
                                             int sak, int sbk, int sbn, int ldc, int, int) {
    const int tiles_n = (N + NAIVE_N - 1) / NAIVE_N;
    const int n = (blockIdx.x % tiles_n) * NAIVE_N + threadIdx.x % NAIVE_N;
    const int m = (blockIdx.x / tiles_n) * NAIVE_M + threadIdx.x / NAIVE_N;
    if (m >= M || n >= N) return;
    float acc = 0.0f;  // fp32 accumulation, as the tensor cores do
    for (int k = 0; k < K; ++k) acc += to_float(a[m * sam + k * sak]) * to_float(b[k * sbk + n * sbn]);
    c[m * ldc + n] = from_float<T>(acc);  // one rounding, at the end
}

MATMUL_ENTRIES(matmul_naive, NAIVE_N * NAIVE_M)
