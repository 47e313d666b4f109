"""Scratch (not part of the course): one launch each of the course's Gluon forward, FlashAttention's
CuTe DSL Hopper forward (flash-attn-4 4.0.0b36) and cuDNN's at (16, 16, 2048, 64) fp16, non-causal
then causal, inside a profiler range (compiled before it), for ncu --profile-from-start off."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from flash_attn.cute import interface as fa
from kernels.flash_attention import gluon_flash

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(16, 16, 2048, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))


def run_all(causal):
    gluon_flash.gluon_attention_forward(q, k, v, causal)
    fa._flash_attn_fwd(qs, ks, vs, causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)


for causal in (False, True):
    run_all(causal)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for causal in (False, True):
    run_all(causal)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done")
