// Step 5's kernels (the template and its reasons are in matmul_mma.cuh): the configurations the
// benchmark compares, and the 32 KB one, any strides, that the wrapper falls back to for operands
// whose rows are not 16-byte packs and where a block cannot have more shared memory. Which one
// the step runs, and why, is in PERFORMANCE.md.
#include "matmul_mma.cuh"

MMA_ENTRIES(128, 256, 32, 64, 64, 4)          // 8 warps, 4 stages: 96 KB (the default)
MMA_ENTRIES(128, 256, 64, 64, 64, 3)          // 8 warps, 3 stages: 144 KB
MMA_ENTRIES(128, 128, 32, 64, 64, 4)          // 4 warps, 4 stages: 64 KB, two blocks an SM
MMA_GENERAL_ENTRIES(128, 128, 32, 64, 32, 2)  // 8 warps, 2 stages: 32 KB
