"""Optimizer-state sharding (ZeRO stage 1, Rajbhandari et al. 2020, arXiv 1910.02054): AdamW keeps
two float32 tensors per parameter, twice the model's size, on every data-parallel rank. Each rank
needs only the state of the parameters it updates.

`ShardedOptimizer(params, torch.optim.AdamW, lr=...)` gives every parameter an owner (the
largest first, each to the rank owning the fewest elements so far, so the shards are about equal),
builds the real optimizer on the owned parameters only, and after each step the owner of each
parameter sends its new values to every other rank (one broadcast per owner, of its parameters
flattened). Gradients must already be averaged across ranks (by `ddp.DataParallel`). Each rank
then holds 1/N of the optimizer state (`state_bytes`), and the parameters stay identical on every
rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer


class ShardedOptimizer(Optimizer):
    def __init__(self, params, optimizer_cls: type[Optimizer], **kwargs):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.owner: dict[torch.Tensor, int] = {}
        self._load = [0] * self.world  # elements owned by each rank
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        self.local: Optimizer | None = None  # the real optimizer, over this rank's parameters
        super().__init__(params, kwargs)  # calls add_param_group for every group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # largest first, each to the least-loaded rank: shards within a few % of 1/N (the same
        # order, so the same owners, on every rank)
        for p in sorted(group["params"], key=lambda p: -p.numel()):
            rank = min(range(self.world), key=self._load.__getitem__)
            self.owner[p] = rank
            self._load[rank] += p.numel()
        mine = {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        if not mine["params"]:
            return
        if self.local is None:
            self.local = self._optimizer_cls([mine], **self._kwargs)
        else:
            self.local.add_param_group(mine)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.local.step(closure) if self.local is not None else None
        params = [p for group in self.param_groups for p in group["params"]]
        for owner in range(self.world):
            owned = [p for p in params if self.owner[p] == owner]
            if not owned:
                continue
            flat = torch.cat([p.view(-1) for p in owned])
            dist.broadcast(flat, src=owner)
            if owner != self.rank:
                for p, new in zip(owned, flat.split([p.numel() for p in owned])):
                    p.copy_(new.view_as(p))
        return loss

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW: exp_avg, exp_avg_sq, step)."""
        return state_bytes(self.local) if self.local is not None else 0


def state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in an optimizer's state (its moments, step counters, ...)."""
    return sum(
        t.numel() * t.element_size()
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if torch.is_tensor(t)
    )
