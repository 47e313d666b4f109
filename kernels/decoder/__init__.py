"""The capstone: a Llama-style decoder whose every operation but the GEMMs runs on the course's
kernels (embedding gather, RMSNorm and the fused residual add, RoPE with the KV-cache append,
FlashAttention-2 prefill, flash-decoding, SwiGLU, greedy argmax), with its decode step captured in a
CUDA graph."""
