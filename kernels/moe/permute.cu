// Token permutation for the MoE layer in CUDA C: the same contract as triton_permute.py, three kernels,
// no host synchronization (every size is a bound known from the shapes).
//
//   moe_histogram: assignments per expert. Each block counts into shared memory with atomics (fast: a
//                  shared atomic is a few cycles), then adds its non-zero bins to the global counts.
//   moe_scan:      one block: pads each count to a multiple of BLOCK_M rows, an exclusive prefix sum
//                  over the experts gives each expert's first row; also each tile's expert, and a
//                  cursor per expert (its first row) for the scatter.
//   moe_scatter:   each assignment takes the next free row of its expert with an atomic on the cursor.
//                  Within an expert, the order of rows is whatever order the atomics ran in; the GEMM
//                  does not care (each row's result depends only on that row) and the combine finds each
//                  assignment's row through row_of.
// The caller zeroes counts and fills sorted_ids with -1 (padding) before the launches.

constexpr int MAX_EXPERTS = 1024;
constexpr int SCAN_THREADS = 1024;  // moe_scan: one thread per expert
constexpr unsigned FULL = 0xffffffffu;

extern "C" __global__ void moe_histogram(const int* __restrict__ ids, int n, int experts, int* __restrict__ counts) {
    __shared__ int bins[MAX_EXPERTS];
    for (int e = threadIdx.x; e < experts; e += blockDim.x) bins[e] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < experts) atomicAdd(&bins[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        if (bins[e]) atomicAdd(&counts[e], bins[e]);
}

// Inclusive prefix sum over the block (blockDim.x == SCAN_THREADS): within each warp by shuffles, then
// over the warps' totals by the first warp.
__device__ int block_inclusive_scan(int v, int* warp_totals) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(FULL, v, d);
        if (lane >= d) v += up;
    }
    if (lane == 31) warp_totals[warp] = v;
    __syncthreads();
    if (warp == 0) {
        int t = warp_totals[lane];  // SCAN_THREADS / 32 == 32 warps
        for (int d = 1; d < 32; d *= 2) {
            const int up = __shfl_up_sync(FULL, t, d);
            if (lane >= d) t += up;
        }
        warp_totals[lane] = t;
    }
    __syncthreads();
    return warp ? v + warp_totals[warp - 1] : v;
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
moe_scan(const int* __restrict__ counts, int experts, int block_m, int max_tiles, int* __restrict__ offsets,
         int* __restrict__ cursor, int* __restrict__ tile_expert) {
    __shared__ int warp_totals[32];
    __shared__ int tile_end[MAX_EXPERTS];  // first tile after each expert's rows
    const int e = threadIdx.x;
    const int padded = e < experts ? (counts[e] + block_m - 1) / block_m * block_m : 0;
    const int end = block_inclusive_scan(padded, warp_totals);
    if (e < experts) {
        offsets[e] = end - padded;
        cursor[e] = end - padded;
        tile_end[e] = end / block_m;
    }
    if (e == experts - 1) offsets[experts] = end;
    __syncthreads();
    // Tile i belongs to the first expert whose rows end after it (binary search); -1 past the last.
    for (int i = threadIdx.x; i < max_tiles; i += blockDim.x) {
        int lo = 0, hi = experts;
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (tile_end[mid] > i) hi = mid; else lo = mid + 1;
        }
        tile_expert[i] = lo < experts ? lo : -1;
    }
}

extern "C" __global__ void moe_scatter(const int* __restrict__ ids, int n, int experts, int* __restrict__ cursor,
                                       int* __restrict__ sorted_ids, int* __restrict__ row_of) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        if (e < 0 || e >= experts) continue;
        const int row = atomicAdd(&cursor[e], 1);
        sorted_ids[row] = i;
        row_of[i] = row;
    }
}
