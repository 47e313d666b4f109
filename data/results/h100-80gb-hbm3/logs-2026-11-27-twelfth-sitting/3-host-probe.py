"""Host microseconds of the pieces of an eager flash_attention call with requires_grad, no launch:
allocation forms, and an autograd Function returning (out, lse) with lse marked non-differentiable
against one returning out alone (lse handed back in a list). Min of 7 repeats of 20000 calls,
interleaved."""

import json
import timeit

import torch

q, k, v = (torch.randn(1, 16, 512, 64, device="cuda", dtype=torch.float16, requires_grad=True)
           for _ in range(3))
scratch = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
shape, lshape = tuple(q.shape), tuple(q.shape[:3])


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty_like(scratch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return None


class OneOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, lse_holder):
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty_like(scratch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        lse_holder.append(lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        return None


apply2 = super(torch.autograd.Function, TwoOutputs).apply
apply1 = super(torch.autograd.Function, OneOutput).apply
cases = {
    "torch.empty with keywords, out + lse": lambda: (
        torch.empty(shape, dtype=torch.float16, device=q.device),
        torch.empty(lshape, dtype=torch.float32, device=q.device)),
    "torch.empty_like, out + lse": lambda: (
        torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(scratch)),
    "Function apply, (out, lse), lse non-differentiable": lambda: apply2(q, k, v, True, None),
    "Function apply, out alone, lse in a list": lambda: apply1(q, k, v, True, None, []),
}
best = {name: float("inf") for name in cases}
for _ in range(7):
    for name, fn in cases.items():
        best[name] = min(best[name], timeit.timeit(fn, number=20000) / 20000 * 1e6)
torch.cuda.synchronize()
for name, us in best.items():
    print(f"{us:7.2f} us  {name}")
print(json.dumps({"us_per_call_min_of_7": best, "gpu": torch.cuda.get_device_name()}))
