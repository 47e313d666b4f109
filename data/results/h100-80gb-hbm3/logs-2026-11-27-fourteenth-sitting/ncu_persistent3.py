"""Scratch (not part of the course): one launch each of the Gluon forward at (16, 16, 2048, 64) fp16
non-causal with the default schedule (3 warpgroups, one CTA a tile), three warpgroups forced onto
the persistent grid (as persistent3_probe.py), and two warpgroups on the persistent grid with the
overlap, inside a profiler range (compiled before it), for ncu --profile-from-start off."""
import torch

from kernels.flash_attention import gluon_flash

resolve = gluon_flash.resolve_schedule
FORCE = {"on": False}


def forced(*args, **kw):
    variant = resolve(*args, **kw)
    if FORCE["on"]:
        variant.update(NUM_WG=3, PERSISTENT=True, CONSUMER_REGS=gluon_flash.CONSUMER_REGS[3])
    return variant


gluon_flash.resolve_schedule = forced
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(16, 16, 2048, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))


def run_all():
    gluon_flash.gluon_attention_forward(q, k, v, False)
    FORCE["on"] = True
    gluon_flash.gluon_attention_forward(q, k, v, False, warpgroups=3)
    FORCE["on"] = False
    gluon_flash.gluon_attention_forward(q, k, v, False, warpgroups=2, persistent=True, overlap=True)


run_all()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
run_all()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done")
