// Step 5's kernels (the template and its reasons are in matmul_mma.cuh): the configuration the
// wrapper runs, and the 48 KB one it falls back to where a block cannot have more shared memory.
// The other configurations measured, and why this one, are in PERFORMANCE.md.
#include "matmul_mma.cuh"

MMA_ENTRIES(128, 256, 64, 64, 64, 3)  // 8 warps, 3 stages: 153 KB (162 KB for B = W.T)
MMA_ENTRIES(128, 128, 32, 64, 32, 2)  // 8 warps, 2 stages: 37 KB (40 KB)
