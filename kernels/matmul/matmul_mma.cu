// Step 5: tensor cores through mma.sync.
//
// One instruction, mma.sync.m16n8k16, has a warp multiply a 16 x 16 tile of A by a 16 x 8 tile of
// B into a 16 x 8 float32 accumulator: 4096 flops, where step 4's FMA did 2 per thread. The
// operands must sit in registers in the layout the instruction expects (the "fragments");
// ldmatrix loads them from shared memory in that layout, four 8 x 8 matrices per instruction.
//
// A block of 8 warps computes a 128 x 128 tile of C, each warp 64 x 32 of it (4 x 4 instructions
// per 16 of K, 64 accumulators per thread). The tiles of A (128 x 32) and B (32 x 128) go to shared
// memory by cp.async (sm_80+: memory to shared memory without passing through registers), into two
// buffers: the next tile loads while the tensor cores work on this one. Rows of the tiles are
// padded by 8 elements (16 bytes) so the 8 rows one ldmatrix reads fall in different banks.
//
// B comes two ways. Stored k by n (row-major B, "nn"), its tile is kept that way and ldmatrix.trans
// turns it around. Stored n by k (B = W.T for an nn.Linear weight W, "nt": matmul_mma_kmajor), its
// tile is kept n by k, which is already the instruction's layout: plain ldmatrix, and 16-byte
// loads along k instead of the element-by-element path a transposed operand otherwise takes.
//
// Portable from sm_75 (fp16 only: Turing's instruction is m16n8k8, so a k16 step is two of them,
// and it has no cp.async, so the tiles are loaded through registers) to sm_90, where wgmma, not
// this instruction, reaches the tensor cores' full rate: see PERFORMANCE.md.
#include "matmul_tiles.cuh"

constexpr int MMA_BM = 128, MMA_BN = 128, MMA_BK = 32;
constexpr int MMA_THREADS = 256;             // 8 warps: 2 along M x 4 along N
constexpr int WARP_M = 64, WARP_N = 32;      // each warp's tile of C
constexpr int FRAG_M = WARP_M / 16;          // 4 m16 tiles per warp
constexpr int FRAG_N = WARP_N / 8;           // 4 n8 tiles per warp
constexpr int PAD = 8;                       // 16 bytes per row: conflict-free ldmatrix
constexpr int K_STRIDE = MMA_BK + PAD;       // 40 elements (80 bytes) per row of a k-major tile
constexpr int N_STRIDE = MMA_BN + PAD;       // 136 elements (272 bytes) per row of an n-major one

template <typename T, bool B_KMAJOR> struct MmaTiles {
    alignas(16) T a[2][MMA_BM][K_STRIDE];    // 2 x 10 KB
    // k by n (2 x 8.5 KB), or n by k (2 x 10 KB)
    alignas(16) T b[2][B_KMAJOR ? MMA_BN : MMA_BK][B_KMAJOR ? K_STRIDE : N_STRIDE];
};

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// One 16-byte pack (row, col .. col + 7) of an operand into shared memory: by cp.async where the
// pack is whole and its rows are 16-byte aligned, else through registers, element by element, with
// zeros past the matrix (a transposed operand, a ragged edge, a misaligned view).
template <typename T>
__device__ __forceinline__ void pack_to_shared(T* dst, const T* p, int row, int col, int rows,
                                               int cols, int s_row, int s_col, bool vec) {
#if __CUDA_ARCH__ >= 800
    if (vec && row < rows && col + 8 <= cols) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
                     "l"(p + row * s_row + col)
                     : "memory");
        return;
    }
#endif
    *reinterpret_cast<uint4*>(dst) = row_pack(p, row, col, rows, cols, s_row, s_col, vec).raw;
}

template <typename T, bool B_KMAJOR>
__device__ __forceinline__ void load_tiles(MmaTiles<T, B_KMAJOR>& tiles, int stage, const T* a,
                                           const T* b,
                                           int m0, int n0, int k0, int M, int N, int K, int sam,
                                           int sak, int sbk, int sbn, bool vec_a, bool vec_b) {
    constexpr int A_PACKS_PER_ROW = MMA_BK / 8, B_PACKS_PER_ROW = MMA_BN / 8;  // 4 and 16
#pragma unroll
    for (int p = threadIdx.x; p < MMA_BM * A_PACKS_PER_ROW; p += MMA_THREADS) {
        const int row = p / A_PACKS_PER_ROW, k = (p % A_PACKS_PER_ROW) * 8;
        pack_to_shared(&tiles.a[stage][row][k], a, m0 + row, k0 + k, M, K, sam, sak, vec_a);
    }
    if constexpr (B_KMAJOR) {  // packs along k of B's columns: rows of W
#pragma unroll
        for (int p = threadIdx.x; p < MMA_BN * A_PACKS_PER_ROW; p += MMA_THREADS) {
            const int n = p / A_PACKS_PER_ROW, k = (p % A_PACKS_PER_ROW) * 8;
            pack_to_shared(&tiles.b[stage][n][k], b, n0 + n, k0 + k, N, K, sbn, sbk, vec_b);
        }
    } else {
#pragma unroll
        for (int p = threadIdx.x; p < MMA_BK * B_PACKS_PER_ROW; p += MMA_THREADS) {
            const int k = p / B_PACKS_PER_ROW, col = (p % B_PACKS_PER_ROW) * 8;
            pack_to_shared(&tiles.b[stage][k][col], b, k0 + k, n0 + col, K, N, sbk, sbn, vec_b);
        }
    }
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most `pending` groups of cp.async are in flight (the tiles before them have landed).
template <int pending>
__device__ __forceinline__ void wait_tiles() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
}

// Four 8 x 8 matrices of 16-bit values from shared memory, each thread giving one row's address;
// `.trans` hands them out transposed (B is stored k-major, the instruction wants it n-major).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

// Which instruction a type takes (NVRTC has no <type_traits>).
template <typename T> constexpr bool is_bf16 = false;
template <> constexpr bool is_bf16<__nv_bfloat16> = true;

// d += a (16 x 16) @ b (16 x 8), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1) {
#if __CUDA_ARCH__ >= 800
    if constexpr (!is_bf16<T>)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    // sm_75: fp16 only (the wrapper refuses bf16 there), k16 as two k8 halves.
    if constexpr (!is_bf16<T>) {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, "
                     "{%6}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(b0));
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, "
                     "{%6}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[2]), "r"(a[3]), "r"(b1));
    } else {
        __trap();
    }
#endif
}

// One warp's 64 x 32 share of a 128 x 128 x 32 step: per 16 of K, 4 ldmatrix for A, 2 for B, and
// 16 mma.
template <typename T, bool B_KMAJOR>
__device__ __forceinline__ void warp_step(const MmaTiles<T, B_KMAJOR>& tiles, int stage, int warp_m,
                                          int warp_n, int lane, float (&acc)[FRAG_M][FRAG_N][4]) {
#pragma unroll
    for (int kk = 0; kk < MMA_BK; kk += 16) {
        // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
        // are the fragment's a0..a3; lane l gives row l % 16 of column block l / 16.
        unsigned a_frag[FRAG_M][4];
#pragma unroll
        for (int i = 0; i < FRAG_M; ++i)
            ldmatrix_x4(a_frag[i],
                        &tiles.a[stage][warp_m * WARP_M + i * 16 + lane % 16][kk + (lane / 16) * 8]);
        // B: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) are b0, b1
        // of two n8 tiles. k by n, transposed: lane l gives row k = l % 16 of column block l / 16.
        // n by k, as stored: lane l gives row n = (l / 16) * 8 + l % 8 of column block (l / 8) % 2.
        unsigned b_frag[FRAG_N][2];
#pragma unroll
        for (int j = 0; j < FRAG_N; j += 2) {
            unsigned r[4];
            const int n = warp_n * WARP_N + j * 8;
            if constexpr (B_KMAJOR)
                ldmatrix_x4(r,
                            &tiles.b[stage][n + (lane / 16) * 8 + lane % 8][kk + (lane / 8) % 2 * 8]);
            else
                ldmatrix_x4_trans(r, &tiles.b[stage][kk + lane % 16][n + (lane / 16) * 8]);
            b_frag[j][0] = r[0], b_frag[j][1] = r[1], b_frag[j + 1][0] = r[2], b_frag[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
            for (int j = 0; j < FRAG_N; ++j) mma_16x8x16<T>(acc[i][j], a_frag[i], b_frag[j][0], b_frag[j][1]);
    }
}

template <typename T, bool B_KMAJOR>
__device__ __forceinline__ void matmul_mma_tiles(const T* __restrict__ a, const T* __restrict__ b,
                                                 T* __restrict__ c, int M, int N, int K, int sam,
                                                 int sak, int sbk, int sbn, int ldc, int vec_a,
                                                 int vec_b) {
    // 37 or 40 KB: under the 48 KB a block gets without an opt-in
    __shared__ MmaTiles<T, B_KMAJOR> tiles;
    int tile_m, tile_n;
    grouped_tile((M + MMA_BM - 1) / MMA_BM, (N + MMA_BN - 1) / MMA_BN, tile_m, tile_n);
    const int m0 = tile_m * MMA_BM, n0 = tile_n * MMA_BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / (MMA_BN / WARP_N), warp_n = warp % (MMA_BN / WARP_N);
    float acc[FRAG_M][FRAG_N][4] = {};

    const int k_tiles = (K + MMA_BK - 1) / MMA_BK;
    load_tiles(tiles, 0, a, b, m0, n0, 0, M, N, K, sam, sak, sbk, sbn, vec_a, vec_b);
    for (int t = 0; t < k_tiles; ++t) {
        if (t + 1 < k_tiles) {  // start the next tile's copy, then wait for this one only
            load_tiles(tiles, (t + 1) % 2, a, b, m0, n0, (t + 1) * MMA_BK, M, N, K, sam, sak, sbk,
                       sbn, vec_a, vec_b);
            wait_tiles<1>();
        } else {
            wait_tiles<0>();
        }
        __syncthreads();  // every thread's copies of tile t have landed
        warp_step(tiles, t % 2, warp_m, warp_n, lane, acc);
        __syncthreads();  // everyone is done with buffer t % 2 before tile t + 2 overwrites it
    }

    // Accumulator layout: d0, d1 at (row lane / 4, columns 2 (lane % 4) + 0, 1); d2, d3 8 rows down.
#pragma unroll
    for (int i = 0; i < FRAG_M; ++i)
#pragma unroll
        for (int j = 0; j < FRAG_N; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int m = m0 + warp_m * WARP_M + i * 16 + lane / 4 + (r / 2) * 8;
                const int n = n0 + warp_n * WARP_N + j * 8 + (lane % 4) * 2 + r % 2;
                if (m < M && n < N) c[m * ldc + n] = from_float<T>(acc[i][j][r]);
            }
}

template <typename T>
__device__ __forceinline__ void matmul_mma(const T* a, const T* b, T* c, int M, int N, int K, int sam,
                                           int sak, int sbk, int sbn, int ldc, int vec_a, int vec_b) {
    matmul_mma_tiles<T, false>(a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);
}

// vec_b here: whether B's columns (W's rows) can be read 16 bytes at a time along k.
template <typename T>
__device__ __forceinline__ void matmul_mma_kmajor(const T* a, const T* b, T* c, int M, int N, int K,
                                                  int sam, int sak, int sbk, int sbn, int ldc,
                                                  int vec_a, int vec_b) {
    matmul_mma_tiles<T, true>(a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);
}

MATMUL_ENTRIES(matmul_mma, MMA_THREADS)
MATMUL_ENTRIES(matmul_mma_kmajor, MMA_THREADS)
