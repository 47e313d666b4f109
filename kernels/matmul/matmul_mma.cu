// Step 5's kernels (the template and its reasons are in matmul_mma.cuh): the configuration the
// wrapper runs, and the 48 KB one it falls back to where a block cannot have more shared memory.
#include "matmul_mma.cuh"

MMA_ENTRIES(128, 256, 32, 64, 64, 4)  // 8 warps, 4 stages: 108 KB (120 KB for B = W.T)
MMA_ENTRIES(128, 128, 32, 64, 32, 2)  // 8 warps, 2 stages: 37 KB (40 KB)
