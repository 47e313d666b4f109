// The other configurations of step 5 that `python -m kernels.matmul.benchmark mma-variants`
// times against matmul_mma.cu's (cupy_matmul.MMA_VARIANTS lists them all).
#include "matmul_mma.cuh"

MMA_ENTRIES(128, 128, 32, 64, 32, 4)  // the fallback's tiles, 4 stages: the pipeline alone
MMA_ENTRIES(128, 128, 32, 64, 64, 4)  // 4 warps of 64 x 64: two blocks an SM
MMA_ENTRIES(128, 256, 32, 64, 64, 3)
MMA_ENTRIES(128, 256, 64, 64, 64, 3)  // half the barriers per flop
MMA_ENTRIES(256, 128, 32, 64, 64, 4)
MMA_ENTRIES(128, 128, 64, 64, 64, 3)  // 4 warps, half the barriers
