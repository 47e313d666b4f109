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
// 16 of K, WM * WN / 32 accumulators per thread). The loop is the one fast Ampere GEMMs run
// (CUTLASS's sm80 "multistage" mainloop), and each of its parts takes away a wait:
//
// - STAGES buffers of A (BM x BK) and B filled by cp.async (memory to shared memory without
//   registers, 16 bytes a copy): the copies of the next STAGES - 1 tiles are in flight while the
//   tensor cores work on this one. One barrier per tile.
// - Shared tiles without padding, 16-byte packs of a row placed at pack ^ (row % 8): the 8 rows
//   one ldmatrix reads, which share their column, land in 8 different groups of 4 banks (the
//   "XOR swizzle"). Each thread's ldmatrix addresses are computed once, before the loop.
// - Fragments double-buffered in registers: the ldmatrix of the next 16 of K (or of the next
//   tile's first 16) is issued before this 16's mma, so its latency hides behind 32 mma.
// - The copies of the next tile are spread over the 16-deep steps of this one, between the mma.
// - A block may own several tiles of C (the persistent launch: a block an SM): their K tiles are
//   one stream, so the next tile's first copies are in flight while this one's C is stored.
//
// B comes two ways. Stored k by n (row-major B, "nn"), its tile is kept that way and ldmatrix.trans
// turns it around. Stored n by k (B = W.T for an nn.Linear weight W, "nt": the _kmajor entries),
// its tile is kept n by k, which is already the instruction's layout: plain ldmatrix, and 16-byte
// loads along k. Operands whose rows are not 16-byte packs (a transposed A, a misaligned view) are
// copied through registers, element by element, into the same layout: right, not fast.
//
// Portable from sm_75 (fp16 only: Turing's instruction is m16n8k8, so a k16 step is two of them,
// and it has no cp.async, so the tiles are loaded through registers) to sm_90, where wgmma, not
// this instruction, reaches the tensor cores' full rate: see PERFORMANCE.md.
#pragma once
#include "matmul_tiles.cuh"

template <int BM_, int BN_, int BK_, int WM_, int WN_, int STAGES_> struct MmaConfig {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr int WARPS_N = BN / WN, THREADS = (BM / WM) * WARPS_N * 32;
    static constexpr int FRAG_M = WM / 16, FRAG_N = WN / 8;  // instructions per warp per k16
    static constexpr int K_STEPS = BK / 16;
    static_assert(BM % WM == 0 && BN % WN == 0 && WM % 16 == 0 && WN % 16 == 0);
    // Rows of 4+ packs, and an even number of k16 steps a tile, so the two fragment buffers
    // alternate across tiles as within one.
    static_assert(BK % 32 == 0 && STAGES >= 2);
};

// cp.async (global to shared memory without registers) is sm_80's; before it, tiles go through
// registers.
#if __CUDA_ARCH__ >= 800
constexpr bool HAS_CP_ASYNC = true;
#else
constexpr bool HAS_CP_ASYNC = false;
#endif

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A ROWS x COLS tile of 16-bit values in shared memory, COLS / 8 packs of 16 bytes a row. Pack
// `pack` of row `row` is stored at pack ^ f(row): with 8+ packs a row, f = row % 8; with 4 (a row
// is half of the 128 bytes the banks span), f = (row / 2) % 4. Either way 8 consecutive rows'
// packs of one column fall in 8 different 16-byte bank groups, for ldmatrix and for cp.async.
template <int ROWS, int COLS> struct SwizzledTile {
    static constexpr int PACKS = COLS / 8, ROW_BYTES = COLS * 2, BYTES = ROWS * ROW_BYTES;
    static_assert(PACKS >= 4 && (PACKS & (PACKS - 1)) == 0);
    __device__ __forceinline__ static int offset(int row, int pack) {  // bytes
        const int f = PACKS >= 8 ? row % 8 : (row / 2) % 4;
        return row * ROW_BYTES + (pack ^ f) * 16;
    }
};

// One operand's tile copied from global memory: `outer` indexes the tile's rows (m of A, k of a
// row-major B, n of B = W.T), `inner` its columns, the matrix is outer_n x inner_n with strides
// (s_outer, s_inner). The block's threads take the packs in turn: each thread has PER_THREAD
// packs in one column, ROW_STEP rows apart.
template <int ROWS, int COLS, int THREADS> struct TileCopy {
    using Tile = SwizzledTile<ROWS, COLS>;
    static constexpr int ROW_STEP = THREADS / Tile::PACKS;
    static constexpr int PER_THREAD = ROWS * Tile::PACKS / THREADS;
    static_assert(THREADS % Tile::PACKS == 0 && ROWS % ROW_STEP == 0 && ROW_STEP % 8 == 0);

    __device__ __forceinline__ static int first_row() { return threadIdx.x / Tile::PACKS; }
    __device__ __forceinline__ static int first_col() { return threadIdx.x % Tile::PACKS * 8; }
    __device__ __forceinline__ static int first_offset() {
        return Tile::offset(first_row(), first_col() / 8);
    }

    // Pack r of a tile wholly inside the matrix, whose rows are 16-byte packs `row_stride`
    // elements apart: `first` is this thread's first pack, `stage` the tile's shared address plus
    // first_offset(). One cp.async, no bounds.
    template <typename T>
    __device__ __forceinline__ static void copy(unsigned stage, const T* first, int r,
                                                int row_stride) {
#if __CUDA_ARCH__ >= 800
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                         stage + r * ROW_STEP * Tile::ROW_BYTES),
                     "l"(first + r * ROW_STEP * row_stride)
                     : "memory");
#endif
    }

    // Pack r of this thread, for the tile whose first row and column are (outer0, inner0), into
    // the tile at `stage`. ASYNC (the operand's rows are 16-byte packs: unit inner stride,
    // aligned; the wrapper decides): by cp.async, whose src-size operand reads only the bytes
    // inside the matrix and fills the rest of the 16 with zeros, so the edges need no other path.
    // Otherwise, and before sm_80, through registers (`vec`: 16-byte loads where they are whole).
    template <bool ASYNC, typename T>
    __device__ __forceinline__ static void pack(char* stage, const T* p, int r, int outer0,
                                                int inner0, int outer_n, int inner_n, int s_outer,
                                                int s_inner, bool vec) {
        const int row = threadIdx.x / Tile::PACKS + r * ROW_STEP, col = threadIdx.x % Tile::PACKS;
        const int outer = outer0 + row, inner = inner0 + col * 8;
        char* dst = stage + Tile::offset(row, col);
#if __CUDA_ARCH__ >= 800
        if constexpr (ASYNC) {
            const int left = outer < outer_n ? inner_n - inner : 0;  // elements inside the matrix
            const int bytes = left >= 8 ? 16 : left > 0 ? 2 * left : 0;
            const T* src = bytes ? p + outer * s_outer + inner : p;  // a valid address either way
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                         ::"r"(shared_address(dst)), "l"(src), "r"(bytes)
                         : "memory");
            return;
        }
#endif
        *reinterpret_cast<uint4*>(dst) =
            row_pack(p, outer, inner, outer_n, inner_n, s_outer, s_inner, vec).raw;
    }
};

// Close a group of cp.async (possibly empty, so every tile counts one group), and wait until at
// most `pending` groups are in flight: the tiles before them have landed.
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
// `.trans` hands them out transposed (B is stored k-major, the instruction wants it n-major). The
// "memory" clobber keeps them after the barrier that says their tile has landed.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
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

// The shared buffers of one configuration, carved out of dynamic shared memory: STAGES tiles of A
// (BM x BK) then STAGES tiles of B (BK x BN, or BN x BK when B_KMAJOR). The wrapper computes the
// same size (cupy_matmul.MmaConfig.shared_bytes).
template <typename C, bool B_KMAJOR> struct MmaTiles {
    using A = TileCopy<C::BM, C::BK, C::THREADS>;
    using B = TileCopy<B_KMAJOR ? C::BN : C::BK, B_KMAJOR ? C::BK : C::BN, C::THREADS>;
    static constexpr int A_BYTES = A::Tile::BYTES, B_BYTES = B::Tile::BYTES;
    static constexpr int BYTES = C::STAGES * (A_BYTES + B_BYTES);
};

// One warp's registers for one 16 of K: FRAG_M fragments of A, FRAG_N of B.
template <typename C> struct Fragments {
    unsigned a[C::FRAG_M][4];
    unsigned b[C::FRAG_N][2];
};

// Where this thread's ldmatrix rows are in a stage, per 16 of K (bytes from the tile's start).
// The swizzle depends on a row only through row % 8, which the warp's and the fragments' offsets
// (multiples of 16 rows, or 8) leave alone, so one address per k16 (A, B = W.T) or per pair of n8
// fragments (row-major B) serves every fragment, plus a constant.
template <typename C, bool B_KMAJOR> struct FragmentAddresses {
    using Tiles = MmaTiles<C, B_KMAJOR>;
    int a[C::K_STEPS];                           // + i * 16 rows for fragment i
    int b[B_KMAJOR ? C::K_STEPS : C::FRAG_N / 2];  // + j * 8 rows (W.T) or kk rows (row-major)

    __device__ __forceinline__ FragmentAddresses(int warp_m, int warp_n, int lane) {
        // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15,
        // k 8-15) are the fragment's a0..a3; lane l gives row l % 16 of pack l / 16.
#pragma unroll
        for (int s = 0; s < C::K_STEPS; ++s)
            a[s] = Tiles::A::Tile::offset(warp_m * C::WM + lane % 16, s * 2 + lane / 16);
        // B: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) are
        // b0, b1 of two n8 fragments. n by k, as stored: lane l gives row n = (l / 16) * 8 + l % 8
        // of pack (l / 8) % 2. k by n, transposed: lane l gives row k = l % 16 of pack l / 16.
        if constexpr (B_KMAJOR) {
#pragma unroll
            for (int s = 0; s < C::K_STEPS; ++s)
                b[s] = Tiles::B::Tile::offset(warp_n * C::WN + (lane / 16) * 8 + lane % 8,
                                              s * 2 + (lane / 8) % 2);
        } else {
#pragma unroll
            for (int j = 0; j < C::FRAG_N; j += 2)
                b[j / 2] =
                    Tiles::B::Tile::offset(lane % 16, (warp_n * C::WN + j * 8) / 8 + lane / 16);
        }
    }

    // The fragments of 16 of K, `step` of the tile, from the stage at a_stage / b_stage.
    __device__ __forceinline__ void load(Fragments<C>& f, unsigned a_stage, unsigned b_stage,
                                         int step) const {
        constexpr int A_ROW = Tiles::A::Tile::ROW_BYTES, B_ROW = Tiles::B::Tile::ROW_BYTES;
#pragma unroll
        for (int i = 0; i < C::FRAG_M; ++i) ldmatrix_x4(f.a[i], a_stage + a[step] + i * 16 * A_ROW);
#pragma unroll
        for (int j = 0; j < C::FRAG_N; j += 2) {
            unsigned r[4];
            if constexpr (B_KMAJOR)
                ldmatrix_x4(r, b_stage + b[step] + j * 8 * B_ROW);
            else
                ldmatrix_x4_trans(r, b_stage + b[j / 2] + step * 16 * B_ROW);
            f.b[j][0] = r[0], f.b[j][1] = r[1], f.b[j + 1][0] = r[2], f.b[j + 1][1] = r[3];
        }
    }
};

template <typename T, typename C, bool B_KMAJOR, bool ASYNC>
__device__ __forceinline__ void matmul_mma_tiles(const T* __restrict__ a, const T* __restrict__ b,
                                                 T* __restrict__ c, int M, int N, int K, int sam,
                                                 int sak, int sbk, int sbn, int ldc, int vec_a,
                                                 int vec_b) {
    using Tiles = MmaTiles<C, B_KMAJOR>;
    using A = typename Tiles::A;
    using B = typename Tiles::B;
    extern __shared__ uint4 mma_shared[];  // 16-byte aligned; size given at launch
    char* const a_tiles = reinterpret_cast<char*>(mma_shared);
    char* const b_tiles = a_tiles + C::STAGES * Tiles::A_BYTES;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_m = warp / C::WARPS_N, warp_n = warp % C::WARPS_N;

    // The block's tiles of C are blockIdx.x, + gridDim.x, + 2 gridDim.x, ... in grouped order:
    // one where the grid has a block a tile, several where it has a block or two an SM (the
    // persistent launch). Its K tiles, over all of its tiles of C, are one stream of `steps`: the
    // copies run STAGES - 1 K tiles ahead of the mma, across tiles of C too, so the next tile's
    // first copies are in flight while this tile's C is stored.
    const int tiles_m = (M + C::BM - 1) / C::BM, tiles_n = (N + C::BN - 1) / C::BN;
    const int k_tiles = (K + C::BK - 1) / C::BK;
    const int my_tiles = (tiles_m * tiles_n - blockIdx.x + gridDim.x - 1) / gridDim.x;
    const int steps = my_tiles * k_tiles;
    auto tile_origin = [&](int j, int& m0, int& n0) {  // of the block's tile j
        int tile_m, tile_n;
        grouped_tile(tiles_m, tiles_n, blockIdx.x + j * gridDim.x, tile_m, tile_n);
        m0 = tile_m * C::BM, n0 = tile_n * C::BN;
    };

    // The copies' cursor: the K tile at k0 of the block's tile j, whose origin is (m0, n0).
    struct {
        int j, k0, m0, n0;
    } next = {0, 0, 0, 0};
    tile_origin(0, next.m0, next.n0);
    auto advance = [&]() {
        next.k0 += C::BK;
        if (next.k0 >= K && ++next.j < my_tiles)
            next.k0 = 0, tile_origin(next.j, next.m0, next.n0);
    };

    // Part `part` of the cursor's copies into buffer `stage`: the packs r with r % parts == part,
    // parts = K_STEPS - 1, so the copies of a K tile are spread over all but its last k16 step.
    // Tiles wholly inside the matrices (all but the edges) skip the bounds: each thread's source
    // is then its first pack plus whole ROW_STEPs of rows, its destination one shared address
    // plus constants (ROW_STEP is a multiple of 8 rows, which leaves the swizzle alone).
    constexpr int PARTS = C::K_STEPS - 1;
    const unsigned a_dst = shared_address(a_tiles) + A::first_offset();
    const unsigned b_dst = shared_address(b_tiles) + B::first_offset();
    auto load_tile = [&](int stage, int part) {
        const int m0 = next.m0, n0 = next.n0, k0 = next.k0;
        if (ASYNC && HAS_CP_ASYNC && m0 + C::BM <= M && n0 + C::BN <= N && k0 + C::BK <= K) {
            const T* a_first = a + (m0 + A::first_row()) * sam + k0 + A::first_col();
            const T* b_first = B_KMAJOR ? b + (n0 + B::first_row()) * sbn + k0 + B::first_col()
                                        : b + (k0 + B::first_row()) * sbk + n0 + B::first_col();
#pragma unroll
            for (int r = part; r < A::PER_THREAD; r += PARTS)
                A::copy(a_dst + stage * Tiles::A_BYTES, a_first, r, sam);
#pragma unroll
            for (int r = part; r < B::PER_THREAD; r += PARTS)
                B::copy(b_dst + stage * Tiles::B_BYTES, b_first, r, B_KMAJOR ? sbn : sbk);
            return;
        }
        char* a_stage = a_tiles + stage * Tiles::A_BYTES;
        char* b_stage = b_tiles + stage * Tiles::B_BYTES;
#pragma unroll
        for (int r = part; r < A::PER_THREAD; r += PARTS)
            A::template pack<ASYNC>(a_stage, a, r, m0, k0, M, K, sam, sak, vec_a);
#pragma unroll
        for (int r = part; r < B::PER_THREAD; r += PARTS) {
            if constexpr (B_KMAJOR)  // rows of W, packs along k
                B::template pack<ASYNC>(b_stage, b, r, n0, k0, N, K, sbn, sbk, vec_b);
            else
                B::template pack<ASYNC>(b_stage, b, r, k0, n0, K, N, sbk, sbn, vec_b);
        }
    };

    float acc[C::FRAG_M][C::FRAG_N][4] = {};

    // Accumulator layout: d0, d1 at (row lane / 4, columns 2 (lane % 4) + 0, 1); d2, d3 8 rows
    // down. The two neighbours go out as one 4-byte store where C's rows allow it.
    const bool pairs = reinterpret_cast<size_t>(c) % 4 == 0 && ldc % 2 == 0;
    auto store_tile = [&](int m0, int n0) {
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
    };

    const FragmentAddresses<C, B_KMAJOR> addresses(warp_m, warp_n, lane);
    const unsigned a_base = shared_address(a_tiles), b_base = shared_address(b_tiles);
    Fragments<C> frag[2];

    // K tile s of the stream goes to buffer s % STAGES. Fill STAGES - 1 buffers; then, during K
    // tile s, copy K tile s + STAGES - 1 into the buffer K tile s - 1 used. The barrier before a
    // K tile's last k16 step says two things: the next K tile has landed for every thread, and
    // every warp has read its fragments of the one before (whose buffer the copies overwrite).
#pragma unroll
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < steps) {
            for (int part = 0; part < PARTS; ++part) load_tile(s, part);
            advance();
        }
        commit_tiles();
    }
    wait_tiles<C::STAGES - 2>();
    __syncthreads();
    int read_stage = 0, write_stage = C::STAGES - 1;
    int tile = 0, k_tile = 0, m0, n0;  // the tile of C the mma work on, and their K tile
    tile_origin(0, m0, n0);
    addresses.load(frag[0], a_base, b_base, 0);
    for (int s = 0; s < steps; ++s) {
#pragma unroll
        for (int step = 0; step < C::K_STEPS; ++step) {
            if (step == C::K_STEPS - 1) {
                commit_tiles();
                wait_tiles<C::STAGES - 2>();
                __syncthreads();
                read_stage = read_stage + 1 == C::STAGES ? 0 : read_stage + 1;
                write_stage = write_stage + 1 == C::STAGES ? 0 : write_stage + 1;
            }
            // The next 16 of K's fragments: this K tile's, or (last step) the next one's first.
            addresses.load(frag[(step + 1) % 2], a_base + read_stage * Tiles::A_BYTES,
                           b_base + read_stage * Tiles::B_BYTES, (step + 1) % C::K_STEPS);
            if (step < PARTS && s + C::STAGES - 1 < steps) {
                load_tile(write_stage, step);
                if (step == PARTS - 1) advance();
            }
            const Fragments<C>& f = frag[step % 2];
#pragma unroll
            for (int i = 0; i < C::FRAG_M; ++i)
#pragma unroll
                for (int jj = 0; jj < C::FRAG_N; ++jj) {
                    const int j = i % 2 ? C::FRAG_N - 1 - jj : jj;  // serpentine: B reused
                    mma_16x8x16<T>(acc[i][j], f.a[i], f.b[j][0], f.b[j][1]);
                }
        }
        if (++k_tile == k_tiles) {  // the tile of C is done: store it, start the next
            store_tile(m0, n0);
#pragma unroll
            for (int i = 0; i < C::FRAG_M; ++i)
#pragma unroll
                for (int j = 0; j < C::FRAG_N; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;
            k_tile = 0;
            if (++tile < my_tiles) tile_origin(tile, m0, n0);
        }
    }
}

// The extern "C" entries of one configuration, named after it (cupy_matmul.MmaConfig.kernel):
// matmul_mma_<BM>x<BN>x<BK>_w<WM>x<WN>_s<STAGES>[_kmajor][_general]_{f16,bf16}. The plain ones
// copy by cp.async and need both operands' rows to be 16-byte packs (for the _kmajor ones, W's
// rows); the _general ones take any strides and run on sm_75.
#define MMA_ENTRY(BM, BN, BK, WM, WN, S, KMAJOR, ASYNC, variant, suffix, T)                       \
    extern "C" __global__ void __launch_bounds__(MmaConfig<BM, BN, BK, WM, WN, S>::THREADS)        \
        matmul_mma_##BM##x##BN##x##BK##_w##WM##x##WN##_s##S##variant##_##suffix(                 \
            const T* a, const T* b, T* c, int M, int N, int K, int sam, int sak, int sbk, int sbn, \
            int ldc, int vec_a, int vec_b) {                                                      \
        matmul_mma_tiles<T, MmaConfig<BM, BN, BK, WM, WN, S>, KMAJOR, ASYNC>(                    \
            a, b, c, M, N, K, sam, sak, sbk, sbn, ldc, vec_a, vec_b);                             \
    }
#define MMA_ENTRIES(BM, BN, BK, WM, WN, S)                                        \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, true, , f16, __half)                  \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, true, , bf16, __nv_bfloat16)          \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, true, _kmajor, f16, __half)            \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, true, _kmajor, bf16, __nv_bfloat16)
#define MMA_GENERAL_ENTRIES(BM, BN, BK, WM, WN, S)                                      \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, false, _general, f16, __half)               \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, false, false, _general, bf16, __nv_bfloat16)       \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, false, _kmajor_general, f16, __half)         \
    MMA_ENTRY(BM, BN, BK, WM, WN, S, true, false, _kmajor_general, bf16, __nv_bfloat16)
