// Step 5: tensor cores through mma.sync, as a template over the block's tile, the warps' tiles and
// the depth of the copy pipeline. matmul_mma.cu instantiates the configurations the wrapper uses
// (PERFORMANCE.md has the others measured).
//
// One instruction, mma.sync.m16n8k16, has a warp multiply a 16 x 16 tile of A by a 16 x 8 tile of
// B into a 16 x 8 float32 accumulator: 4096 flops, where step 4's FMA did 2 per thread. The
// operands must sit in registers in the layout the instruction expects (the "fragments");
// ldmatrix loads them from shared memory in that layout, four 8 x 8 matrices per instruction.
//
// A block computes a BM x BN tile of C, each warp WM x WN of it (WM / 16 x WN / 8 instructions per
// 16 of K, WM * WN / 32 accumulators per thread). The tiles of A (BM x BK) and B (BK x BN) go to
// shared memory by cp.async (sm_80+: memory to shared memory without passing through registers)
// into STAGES buffers: the copies of the next STAGES - 1 tiles are in flight while the tensor
// cores work on this one, which hides the memory's latency behind more than one tile's math. Rows
// of the tiles are padded by 8 elements (16 bytes) so the 8 rows one ldmatrix reads fall in
// different banks. Past 48 KB the buffers are dynamic shared memory, which the launcher opts in to.
//
// B comes two ways. Stored k by n (row-major B, "nn"), its tile is kept that way and ldmatrix.trans
// turns it around. Stored n by k (B = W.T for an nn.Linear weight W, "nt": the _kmajor entries),
// its tile is kept n by k, which is already the instruction's layout: plain ldmatrix, and 16-byte
// loads along k instead of the element-by-element path a transposed operand otherwise takes.
//
// Portable from sm_75 (fp16 only: Turing's instruction is m16n8k8, so a k16 step is two of them,
// and it has no cp.async, so the tiles are loaded through registers) to sm_90, where wgmma, not
// this instruction, reaches the tensor cores' full rate: see PERFORMANCE.md.
#pragma once
#include "matmul_tiles.cuh"

constexpr int MMA_PAD = 8;  // 16 bytes per row: conflict-free ldmatrix

template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_> struct MmaConfig {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr int WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
    static constexpr int FRAG_M = WM / 16, FRAG_N = WN / 8;  // instructions per warp per k16
    static constexpr int K_STRIDE = BK + MMA_PAD;             // a row of a k-major tile
    static constexpr int N_STRIDE = BN + MMA_PAD;             // a row of an n-major one
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0);
    static_assert(STAGES >= 2);
};

// The shared buffers of one configuration, carved out of dynamic shared memory: STAGES tiles of A
// (BM x BK, k-major) then STAGES tiles of B (BK x BN, or BN x BK when B_KMAJOR). The wrapper
// computes the same size (cupy_matmul.MmaConfig.shared_bytes).
template <typename T, typename C, bool B_KMAJOR> struct MmaTiles {
    static constexpr int A_STAGE = C::BM * C::K_STRIDE;
    static constexpr int B_STAGE = B_KMAJOR ? C::BN * C::K_STRIDE : C::BK * C::N_STRIDE;
    T* base;
    __device__ __forceinline__ T* a(int stage, int row, int k) const {
        return base + stage * A_STAGE + row * C::K_STRIDE + k;
    }
    __device__ __forceinline__ T* b(int stage, int row, int col) const {  // (k, n) or (n, k)
        return base + C::STAGES * A_STAGE + stage * B_STAGE
               + row * (B_KMAJOR ? C::K_STRIDE : C::N_STRIDE) + col;
    }
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

// `packs` 16-byte packs of a tile, `per_row` to a row, spread over the block's threads.
template <typename C, typename Dst>
__device__ __forceinline__ void tile_to_shared(int packs, int per_row, Dst&& to_shared) {
#pragma unroll
    for (int p = threadIdx.x; p < packs; p += C::THREADS) to_shared(p / per_row, (p % per_row) * 8);
}

template <typename T, typename C, bool B_KMAJOR>
__device__ __forceinline__ void load_tiles(const MmaTiles<T, C, B_KMAJOR>& tiles, int stage,
                                           const T* a, const T* b, int m0, int n0, int k0, int M,
                                           int N, int K, int sam, int sak, int sbk, int sbn,
                                           bool vec_a, bool vec_b) {
    tile_to_shared<C>(C::BM * C::BK / 8, C::BK / 8, [&](int row, int k) {
        pack_to_shared(tiles.a(stage, row, k), a, m0 + row, k0 + k, M, K, sam, sak, vec_a);
    });
    if constexpr (B_KMAJOR)  // packs along k of B's columns: rows of W
        tile_to_shared<C>(C::BN * C::BK / 8, C::BK / 8, [&](int n, int k) {
            pack_to_shared(tiles.b(stage, n, k), b, n0 + n, k0 + k, N, K, sbn, sbk, vec_b);
        });
    else
        tile_to_shared<C>(C::BK * C::BN / 8, C::BN / 8, [&](int k, int col) {
            pack_to_shared(tiles.b(stage, k, col), b, k0 + k, n0 + col, K, N, sbk, sbn, vec_b);
        });
}

// Close a group of cp.async (possibly empty, so every iteration counts one group), and wait until
// at most `pending` groups are in flight: the tiles before them have landed.
__device__ __forceinline__ void commit_tiles() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
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

// d += a (16 x 16) @ b (16 x 8), float32 accumulators. Not volatile: the instruction only reads
// and writes registers, so the compiler may move the next fragments' ldmatrix above it.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                            unsigned b1) {
#if __CUDA_ARCH__ >= 800
    if constexpr (!is_bf16<T>)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    // sm_75: fp16 only (the wrapper refuses bf16 there), k16 as two k8 halves.
    if constexpr (!is_bf16<T>) {
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, "
            "{%6}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(b0));
        asm("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, "
            "{%6}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[2]), "r"(a[3]), "r"(b1));
    } else {
        __trap();
    }
#endif
}

// One warp's WM x WN share of a BM x BN x BK step: per 16 of K, FRAG_M ldmatrix for A, FRAG_N / 2
// for B, and FRAG_M x FRAG_N mma. The loop over k is unrolled, so the next k16's fragments load
// while this one's instructions run (the compiler's register double buffer).
template <typename T, typename C, bool B_KMAJOR>
__device__ __forceinline__ void warp_step(const MmaTiles<T, C, B_KMAJOR>& tiles, int stage,
                                          int warp_m, int warp_n, int lane,
                                          float (&acc)[C::FRAG_M][C::FRAG_N][4]) {
#pragma unroll
    for (int kk = 0; kk < C::BK; kk += 16) {
        // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
        // are the fragment's a0..a3; lane l gives row l % 16 of column block l / 16.
        unsigned a_frag[C::FRAG_M][4];
#pragma unroll
        for (int i = 0; i < C::FRAG_M; ++i)
            ldmatrix_x4(a_frag[i], tiles.a(stage, warp_m * C::WM + i * 16 + lane % 16,
                                           kk + (lane / 16) * 8));
        // B: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) are b0, b1
        // of two n8 tiles. k by n, transposed: lane l gives row k = l % 16 of column block l / 16.
        // n by k, as stored: lane l gives row n = (l / 16) * 8 + l % 8 of column block (l / 8) % 2.
        unsigned b_frag[C::FRAG_N][2];
#pragma unroll
        for (int j = 0; j < C::FRAG_N; j += 2) {
            unsigned r[4];
            const int n = warp_n * C::WN + j * 8;
            if constexpr (B_KMAJOR)
                ldmatrix_x4(r, tiles.b(stage, n + (lane / 16) * 8 + lane % 8,
                                       kk + (lane / 8) % 2 * 8));
            else
                ldmatrix_x4_trans(r, tiles.b(stage, kk + lane % 16, n + (lane / 16) * 8));
            b_frag[j][0] = r[0], b_frag[j][1] = r[1], b_frag[j + 1][0] = r[2], b_frag[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < C::FRAG_M; ++i)
#pragma unroll
            for (int j = 0; j < C::FRAG_N; ++j)
                mma_16x8x16<T>(acc[i][j], a_frag[i], b_frag[j][0], b_frag[j][1]);
    }
}

template <typename T, typename C, bool B_KMAJOR>
__device__ __forceinline__ void matmul_mma_tiles(const T* __restrict__ a, const T* __restrict__ b,
                                                 T* __restrict__ c, int M, int N, int K, int sam,
                                                 int sak, int sbk, int sbn, int ldc, int vec_a,
                                                 int vec_b) {
    extern __shared__ uint4 mma_shared[];  // 16-byte aligned; size given at launch
    const MmaTiles<T, C, B_KMAJOR> tiles{reinterpret_cast<T*>(mma_shared)};
    int tile_m, tile_n;
    grouped_tile((M + C::BM - 1) / C::BM, (N + C::BN - 1) / C::BN, tile_m, tile_n);
    const int m0 = tile_m * C::BM, n0 = tile_n * C::BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / C::WARPS_N, warp_n = warp % C::WARPS_N;
    float acc[C::FRAG_M][C::FRAG_N][4] = {};

    // Tile t goes to buffer t % STAGES. Fill STAGES - 1 buffers, then each iteration waits for
    // tile t, starts the copy of tile t + STAGES - 1 into the buffer tile t - 1 used, and
    // multiplies tile t. One barrier per tile: it says tile t has landed for every thread and that
    // every warp is done with tile t - 1, whose buffer the new copy overwrites.
    const int k_tiles = (K + C::BK - 1) / C::BK;
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < k_tiles)
            load_tiles(tiles, s, a, b, m0, n0, s * C::BK, M, N, K, sam, sak, sbk, sbn, vec_a, vec_b);
        commit_tiles();
    }
    int read_stage = 0, write_stage = C::STAGES - 1;
    for (int t = 0; t < k_tiles; ++t) {
        wait_tiles<C::STAGES - 2>();
        __syncthreads();
        const int next = t + C::STAGES - 1;
        if (next < k_tiles)
            load_tiles(tiles, write_stage, a, b, m0, n0, next * C::BK, M, N, K, sam, sak, sbk, sbn,
                       vec_a, vec_b);
        commit_tiles();
        warp_step(tiles, read_stage, warp_m, warp_n, lane, acc);
        read_stage = read_stage + 1 == C::STAGES ? 0 : read_stage + 1;
        write_stage = write_stage + 1 == C::STAGES ? 0 : write_stage + 1;
    }

    // Accumulator layout: d0, d1 at (row lane / 4, columns 2 (lane % 4) + 0, 1); d2, d3 8 rows down.
    // The two neighbours go out as one 4-byte store where C's rows allow it.
    const bool pairs = reinterpret_cast<size_t>(c) % 4 == 0 && ldc % 2 == 0;
#pragma unroll
    for (int i = 0; i < C::FRAG_M; ++i)
#pragma unroll
        for (int j = 0; j < C::FRAG_N; ++j)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int m = m0 + warp_m * C::WM + i * 16 + lane / 4 + half * 8;
                const int n = n0 + warp_n * C::WN + j * 8 + (lane % 4) * 2;
                if (m >= M) continue;
                const T lo = from_float<T>(acc[i][j][2 * half]);
                const T hi = from_float<T>(acc[i][j][2 * half + 1]);
                T* row = c + m * ldc;
                if (pairs && n + 1 < N) {
                    struct alignas(4) Pair { T lo, hi; };
                    *reinterpret_cast<Pair*>(row + n) = Pair{lo, hi};
                } else {
                    if (n < N) row[n] = lo;
                    if (n + 1 < N) row[n + 1] = hi;
                }
            }
}

// The extern "C" entries of one configuration, named after it (cupy_matmul.MmaConfig.kernel):
// matmul_mma_<BM>x<BN>x<BK>_w<WM>x<WN>_s<STAGES>[_kmajor]_{f16,bf16}. vec_b for the _kmajor ones:
// whether B's columns (W's rows) can be read 16 bytes at a time along k.
#define MMA_ENTRY(BM, BN, BK, WM, WN, S, KMAJOR, kmajor_suffix, suffix, T)                          \
    extern "C" __global__ void __launch_bounds__(MmaConfig<BM, BN, BK, WM, WN, S>::THREADS)          \
        matmul_mma_##BM##x##BN##x##BK##_w##WM##x##WN##_s##S##kmajor_suffix##_##suffix(             \
            const T* a, const T* b, T* c, int M, int N, int K, int sam, int sak, int sbk, int sbn,  \
            int ldc, int vec_a, int vec_b) {                                                        \
        matmul_mma_tiles<T, MmaConfig<BM, BN, BK, WM, WN, S>, KMAJOR>(a, b, c, M, N, K, sam, sak,  \
                                                                      sbk, sbn, ldc, vec_a, vec_b); \
    }
#define MMA_ENTRIES(BM, BN, BK, WM, WN, S)                                   \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, , f16, __half)                   \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, , bf16, __nv_bfloat16)           \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, _kmajor, f16, __half)             \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, _kmajor, bf16, __nv_bfloat16)
