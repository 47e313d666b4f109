"""Data parallelism: every rank holds the whole model, takes its own slice of the batch, and the
ranks average their gradients before the optimizer step, so every replica takes the same step.

`DataParallel(model, bucket_mb, overlap=True)` averages the gradients *during* the backward pass:

* the parameters are grouped, in reverse order (the order backward produces their gradients), into
  buckets of about `bucket_mb` MiB; `bucket_mb=0` gives one bucket per parameter;
* a hook on each parameter (`register_post_accumulate_grad_hook`) fires once its gradient is
  complete; when the last gradient of a bucket arrives, the bucket is flattened into one buffer and
  its all-reduce starts asynchronously (`async_op=True`) while backward goes on;
* `finish_gradient_synchronization()`, called after `backward()`, waits for the outstanding
  all-reduces, divides by the number of ranks and writes the averages back into `.grad`.

Buckets start in bucket order on every rank (a bucket that completes early waits for the ones before
it): collectives must be issued in the same order everywhere. Fewer, larger buckets pay the
per-message latency fewer times; smaller ones start earlier and leave less to do after backward.
`overlap=False` starts every all-reduce only when `finish_gradient_synchronization()` is called (the
naive data parallelism the overlap is measured against). The time that call waited is kept in
`exposed_s`: the communication the backward pass did not hide.

`against_one_process(rank, world, ...)`, run in every rank by `launch.run`, checks it against
training the same model in one process on the whole batch.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.flat = torch.empty(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = self.flat.split([p.numel() for p in params])
        self.ready = 0
        self.work = None

    def launch(self) -> None:
        for p, view in zip(self.params, self.views):
            if p.grad is None:  # a parameter this step did not use: it contributes zero
                view.zero_()
            else:
                view.copy_(p.grad.view(-1))
        self.work = dist.all_reduce(self.flat, async_op=True)


def make_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters (in the order given) grouped until a bucket holds at least
    `bucket_mb` MiB; 0 gives one parameter per bucket."""
    limit = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, overlap: bool = True):
        super().__init__()
        self.module = module
        self.overlap = overlap
        self.world = dist.get_world_size()
        with torch.no_grad():  # every replica starts from rank 0's weights
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [_Bucket(b) for b in make_buckets(params[::-1], bucket_mb)]
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next = 0  # the next bucket to launch: buckets start in order on every rank
        self.exposed_s = 0.0
        if overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter) -> None:
        self._bucket_of[param].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(
            self.buckets[self._next].params
        ):
            self.buckets[self._next].launch()
            self._next += 1

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (starting those not started), average, write back."""
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is None:
                bucket.launch()
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.flat.div_(self.world)  # gloo has no average: sum, then divide
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    p.grad = view.view_as(p).clone()
                else:
                    p.grad.copy_(view.view_as(p))
            bucket.ready, bucket.work = 0, None
        self._next = 0
        self.exposed_s = time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# Check: the replicas against one process training on the whole batch


def against_one_process(rank, world, bucket_mb, overlap=True, steps=3, batch=4, seq=16):
    """Train a replica with DataParallel on this rank's rows and the same tiny GPT in one process
    on the whole batch (SGD: its update is linear in the gradient, so the replicas stay within
    float32 rounding of it). Rank 1 starts from other weights: DataParallel must copy rank 0's.
    Returns (largest gradient difference relative to the gradient's size, largest weight
    difference, number of buckets, buckets started during each backward). A module function, so
    that `launch.run` can spawn its ranks where forking is unsafe (a GPU machine)."""
    from kernels.memory_profiling import gpt

    cfg = gpt.GPTConfig(vocab=97, max_seq=seq, d_model=32, layers=2, heads=4)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    single = copy.deepcopy(model)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    wrapped = DataParallel(model, bucket_mb=bucket_mb, overlap=overlap)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (wrapped, single)]
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    grad_err, started_in_backward = 0.0, []
    for step in range(steps):
        idx, targets = gpt.make_batch(cfg, batch, seq, "cpu", seed=step)
        wrapped(idx[rows], targets[rows]).backward()
        started_in_backward.append(sum(b.work is not None for b in wrapped.buckets))
        wrapped.finish_gradient_synchronization()
        single(idx, targets).backward()
        for a, b in zip(model.parameters(), single.parameters()):
            scale = b.grad.abs().max() + 1e-30
            grad_err = max(grad_err, float(((a.grad - b.grad).abs() / scale).max()))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    weight_err = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), single.parameters())
    )
    return grad_err, weight_err, len(wrapped.buckets), started_in_backward
