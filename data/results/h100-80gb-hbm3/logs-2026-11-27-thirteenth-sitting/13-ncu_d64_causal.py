"""Scratch (not part of the course): one launch each, inside a profiler range (compiled before it),
at (16, 16, 2048, 64) fp16 causal: the Gluon forward with FlashAttention's D 64 schedule (3 consumer
warpgroups, the overlap, the turns, a ring of 2, one CTA a tile), the Gluon default (2 warpgroups,
persistent), and FlashAttention's CuTe DSL forward (flash-attn-4 4.0.0b36); for ncu
--profile-from-start off."""
import torch
from flash_attn.cute import interface as fa
from kernels.flash_attention import gluon_flash

g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(16, 16, 2048, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))
three = dict(warpgroups=3, overlap=True, persistent=False, stages=2)


def run_all():
    gluon_flash.gluon_attention_forward(q, k, v, True, **three)
    gluon_flash.gluon_attention_forward(q, k, v, True)
    fa._flash_attn_fwd(qs, ks, vs, causal=True)


run_all()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
run_all()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done")
