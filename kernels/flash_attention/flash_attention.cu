// FlashAttention forward in CUDA C: the algorithm at the level of one thread.
//
//   out = softmax(scale * q k^T) v,   lse = log(sum_j exp(scale * q . k_j))   (per query row)
//
// The naive version writes the Nq x Nk score matrix to memory, then reads it back twice (softmax, then
// P @ V). Here a block owns BLOCK_M query rows and walks over the keys BLOCK_N at a time; the scores of
// one tile live in registers and shared memory only, so memory holds q, k, v, out and lse: O(N), not O(N^2).
//
// What makes that possible is the *online softmax*. Each query row keeps three things while it walks:
//   m    the largest score seen so far (the softmax is computed relative to it, so exp never overflows),
//   l    the sum of exp(score - m) over the keys seen so far,
//   acc  the sum of exp(score - m) * v over the keys seen so far (a D-vector, in float32).
// A new tile may raise the maximum from m to m'. Everything accumulated so far was weighted by
// exp(. - m); multiplying l and acc by alpha = exp(m - m') re-weights it to exp(. - m'), exactly. At the
// end out = acc / l and lse = m + log(l). Scores are kept in base 2: q is multiplied by scale * log2(e)
// once when it is loaded, so every exponential is a single exp2 (the hardware's ex2 instruction).
//
// Thread layout (THREADS = 128, BLOCK_M = 16): query row r of the block belongs to the 8 consecutive
// lanes 8r .. 8r+7 of one warp. For the scores, lane t of a row computes keys t, t+8, t+16, ... of the
// tile; for the output, lane t owns head dimensions t, t+8, t+16, ... of acc. A row's max and sum are
// reduced across its 8 lanes with three warp shuffles, and its probabilities go through shared memory
// (p_s) from the lanes that computed them to the lanes that multiply them into V.
//
// Shared memory holds the block's Q (loaded once) and the current K and V tiles, all converted to
// float32 as they are loaded, so the arithmetic is float32 whatever the input type. K's and Q's rows are
// padded to D + 1 floats: the 8 lanes of a row read K rows t, t+8, ... at the same column, and with an
// unpadded row of D floats (a multiple of 32 banks) they would all hit the same bank.
//
// Causal masking is bottom-right aligned: query row i sees keys j <= i + (Nk - Nq), as a decode step
// does against its KV cache. Key tiles wholly to the right of the block's last row are never loaded (the
// loop stops early: about half the work of a square causal problem is skipped); the tiles that cross the
// diagonal are masked element by element. A query row that sees no key at all gets out = 0, lse = -inf.
// Blocks are numbered so that the heaviest causal query blocks (the last rows) start first.
//
// Grouped-query attention: query head h reads KV head h / (Hq / Hkv); K and V are never copied.
//
// This kernel teaches the algorithm; it is not tuned. Its matrix products are float32 FMAs from shared
// memory (no tensor cores, no 16-byte loads, no double buffering): kernels/flash_attention/triton_flash.py is
// the fast one. Shared memory per block stays under the 48 KB a kernel gets without opting in:
// D = 64 uses 64-key tiles (41 KB), D = 128 uses 32-key tiles (43 KB).
#include <math_constants.h>

#include "elementwise.cuh"

constexpr int BLOCK_M = 16;         // query rows per block
constexpr int THREADS_PER_ROW = 8;  // consecutive lanes of one warp share a query row
constexpr int THREADS = BLOCK_M * THREADS_PER_ROW;
constexpr float LN2 = 0.6931471805599453f;

static_assert(32 % THREADS_PER_ROW == 0, "a query row's lanes must lie in one warp");

// The max / sum over the THREADS_PER_ROW lanes of a row. XOR offsets below THREADS_PER_ROW stay inside
// the row's group of lanes; every lane of the warp takes part, and every lane ends with the result.
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename T, int D, bool CAUSAL>
__device__ __forceinline__ void flash_attention_forward(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
    float* __restrict__ lse, int n_heads, int n_kv_heads, int n_q, int n_k,
    long long q_sb, long long q_sh, long long q_sn, long long k_sb, long long k_sh, long long k_sn,
    long long v_sb, long long v_sh, long long v_sn, long long o_sb, long long o_sh, long long o_sn,
    float scale_log2) {
    constexpr int BLOCK_N = D == 64 ? 64 : 32;  // keys per tile
    constexpr int KEYS_PER_THREAD = BLOCK_N / THREADS_PER_ROW;
    constexpr int DIMS_PER_THREAD = D / THREADS_PER_ROW;
    static_assert(D % 32 == 0 && BLOCK_N % THREADS_PER_ROW == 0, "tile shapes");

    __shared__ float q_s[BLOCK_M][D + 1];  // +1: see the padding note above
    __shared__ float k_s[BLOCK_N][D + 1];
    __shared__ float v_s[BLOCK_N][D];      // read along a row (consecutive lanes, consecutive columns)
    __shared__ float p_s[BLOCK_M][BLOCK_N + 1];

    // Which query block, head and batch element this block computes (a 1-D grid, blocks of one head
    // adjacent so they share that head's K and V in L2; the last query block of a head first).
    const int m_blocks = (n_q + BLOCK_M - 1) / BLOCK_M;
    const int m_block = m_blocks - 1 - (int)(blockIdx.x % m_blocks);
    const int head_index = (int)(blockIdx.x / m_blocks);  // batch * n_heads + head
    const int head = head_index % n_heads, batch = head_index / n_heads;
    const int kv_head = head / (n_heads / n_kv_heads);
    q += batch * q_sb + head * q_sh;
    k += batch * k_sb + kv_head * k_sh;
    v += batch * v_sb + kv_head * v_sh;
    out += batch * o_sb + head * o_sh;
    lse += (long long)head_index * n_q;

    const int m0 = m_block * BLOCK_M;
    const int r = threadIdx.x / THREADS_PER_ROW, lane = threadIdx.x % THREADS_PER_ROW;
    const int row = m0 + r;           // this thread's query row (rows past n_q compute, but store nothing)
    const int diagonal = n_k - n_q;   // causal: row i sees keys j <= i + diagonal

    // Q, scaled into base 2 once. Rows past n_q are zeros: finite, and never stored.
    for (int e = threadIdx.x; e < BLOCK_M * D; e += THREADS) {
        const int rr = e / D, d = e % D;
        q_s[rr][d] = m0 + rr < n_q ? to_float(q[(m0 + rr) * q_sn + d]) * scale_log2 : 0.f;
    }

    // Causal: keys past the last row's diagonal are masked for every row of the block, so their tiles
    // are skipped. The bound is the same for all threads of the block (they all pass every barrier).
    const int n_end = CAUSAL ? min(n_k, min(m0 + BLOCK_M, n_q) + diagonal) : n_k;

    float m_i = -CUDART_INF_F;  // running max (base 2)
    float l_i = 0.f;            // running sum of exp2(score - m_i)
    float acc[DIMS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < DIMS_PER_THREAD; ++j) acc[j] = 0.f;

    for (int n0 = 0; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();  // the previous tile's K, V and p are no longer read (and q_s is written)
        // Stage the K and V tiles: consecutive threads load consecutive elements of a key's row
        // (coalesced). Keys past n_k are zeros, so a masked key's V can never turn 0 * p into NaN.
        for (int e = threadIdx.x; e < BLOCK_N * D; e += THREADS) {
            const int c = e / D, d = e % D;
            const bool in_range = n0 + c < n_k;
            k_s[c][d] = in_range ? to_float(k[(n0 + c) * k_sn + d]) : 0.f;
            v_s[c][d] = in_range ? to_float(v[(n0 + c) * v_sn + d]) : 0.f;
        }
        __syncthreads();

        // 1. Scores of this thread's keys lane, lane + 8, ...: dot products of length D, in float32.
        float s[KEYS_PER_THREAD];
#pragma unroll
        for (int i = 0; i < KEYS_PER_THREAD; ++i) s[i] = 0.f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) {
            const float qd = q_s[r][d];
#pragma unroll
            for (int i = 0; i < KEYS_PER_THREAD; ++i) s[i] += qd * k_s[lane + i * THREADS_PER_ROW][d];
        }

        // 2. Mask, and the row's maximum over the tile (then over everything seen so far).
        float tile_max = -CUDART_INF_F;
#pragma unroll
        for (int i = 0; i < KEYS_PER_THREAD; ++i) {
            const int key = n0 + lane + i * THREADS_PER_ROW;
            const bool visible = key < n_k && (!CAUSAL || key <= row + diagonal);
            s[i] = visible ? s[i] : -CUDART_INF_F;
            tile_max = fmaxf(tile_max, s[i]);
        }
        const float m_new = fmaxf(m_i, row_max(tile_max));
        // A row that has seen no visible key yet has m_new = -inf; subtracting 0 instead keeps
        // exp2(-inf - (-inf)) = NaN out: its p and alpha are then exp2(-inf) = 0.
        const float m_ref = m_new == -CUDART_INF_F ? 0.f : m_new;

        // 3. Probabilities relative to the new max, and the rescale of what was accumulated.
        const float alpha = exp2f(m_i - m_ref);
        float p_sum = 0.f;
#pragma unroll
        for (int i = 0; i < KEYS_PER_THREAD; ++i) {
            const float p = exp2f(s[i] - m_ref);
            p_s[r][lane + i * THREADS_PER_ROW] = p;
            p_sum += p;
        }
        l_i = l_i * alpha + row_sum(p_sum);
        m_i = m_new;
#pragma unroll
        for (int j = 0; j < DIMS_PER_THREAD; ++j) acc[j] *= alpha;
        __syncwarp();  // the row's p were written by its 8 lanes, all in this warp; now each reads all

        // 4. acc += p @ V_tile for this thread's head dimensions lane, lane + 8, ...
        for (int c = 0; c < BLOCK_N; ++c) {
            const float p = p_s[r][c];
#pragma unroll
            for (int j = 0; j < DIMS_PER_THREAD; ++j) acc[j] += p * v_s[c][lane + j * THREADS_PER_ROW];
        }
    }

    // 5. Normalize once, round once to T. A row that saw no key: out = 0, lse = -inf.
    if (row < n_q) {
        const float inv_l = l_i > 0.f ? 1.f / l_i : 0.f;
#pragma unroll
        for (int j = 0; j < DIMS_PER_THREAD; ++j)
            out[row * o_sn + lane + j * THREADS_PER_ROW] = from_float<T>(acc[j] * inv_l);
        if (lane == 0) lse[row] = l_i > 0.f ? (m_i + log2f(l_i)) * LN2 : -CUDART_INF_F;
    }
}

// extern "C" entry points: flash_attention_fwd_{f32,f16,bf16}_d{64,128}_{causal,full}. One block of
// THREADS threads per (query block of BLOCK_M rows, head, batch element); strides in elements; lse is a
// contiguous float32 (batch, heads, n_q) tensor; scale_log2 = scale * log2(e).
#define FLASH_ATTENTION_KERNEL(suffix, T, D, causal_name, CAUSAL)                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_attention_fwd_##suffix##_d##D##_##causal_name( \
        const T* q, const T* k, const T* v, T* out, float* lse, int n_heads, int n_kv_heads, int n_q, int n_k, \
        long long q_sb, long long q_sh, long long q_sn, long long k_sb, long long k_sh, long long k_sn,       \
        long long v_sb, long long v_sh, long long v_sn, long long o_sb, long long o_sh, long long o_sn,       \
        float scale_log2) {                                                                                   \
        flash_attention_forward<T, D, CAUSAL>(q, k, v, out, lse, n_heads, n_kv_heads, n_q, n_k, q_sb, q_sh,   \
                                              q_sn, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sn,     \
                                              scale_log2);                                                    \
    }
#define FLASH_ATTENTION_DTYPE(suffix, T)                  \
    FLASH_ATTENTION_KERNEL(suffix, T, 64, full, false)    \
    FLASH_ATTENTION_KERNEL(suffix, T, 64, causal, true)   \
    FLASH_ATTENTION_KERNEL(suffix, T, 128, full, false)   \
    FLASH_ATTENTION_KERNEL(suffix, T, 128, causal, true)

FLASH_ATTENTION_DTYPE(f32, float)
FLASH_ATTENTION_DTYPE(f16, __half)
FLASH_ATTENTION_DTYPE(bf16, __nv_bfloat16)
