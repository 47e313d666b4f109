"""All-reduce as a ring of point-to-point messages: reduce-scatter, then all-gather.

Cut the tensor into N chunks (N ranks; sizes differ by at most one element when N does not divide
it). Rank r sends to r + 1 and receives from r - 1 (mod N).

* Reduce-scatter, N - 1 steps: at step s rank r sends chunk (r - s) and adds what it receives into
  chunk (r - s - 1). After the last step rank r holds the full sum of chunk (r + 1).
* All-gather, N - 1 steps: at step s rank r sends chunk (r + 1 - s) and overwrites chunk (r - s)
  with what it receives. After the last step every rank holds every summed chunk.

Each rank sends 2 (N - 1) chunks of S / N bytes: 2 (N - 1) / N * S, nearly independent of N, which
is why rings are bandwidth-optimal (`cost_model.ring_bytes_per_rank`). Each step posts its send and
its receive together (`batch_isend_irecv`), so no rank waits for its left neighbour to finish
sending before it starts its own send: with NCCL a lone blocking send around a ring would
deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (or average) `tensor` across the ranks of the default process group, in place, through
    the ring above; returns `tensor`. Same contract as `dist.all_reduce(tensor)`."""
    if not tensor.is_contiguous():
        raise ValueError(
            "ring_all_reduce works in place on a contiguous tensor; pass x.contiguous()"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1:
        chunks = tensor.view(-1).tensor_split(world)  # views into tensor; the first are the longest
        right, left = (rank + 1) % world, (rank - 1) % world
        inbox = torch.empty_like(chunks[0])
        for step in range(world - 1):  # reduce-scatter
            send, recv = (rank - step) % world, (rank - step - 1) % world
            received = inbox[: chunks[recv].numel()]
            _exchange(chunks[send], right, received, left)
            chunks[recv].add_(received)
        for step in range(world - 1):  # all-gather
            send, recv = (rank + 1 - step) % world, (rank - step) % world
            _exchange(chunks[send], right, chunks[recv], left)
    if average:
        tensor.div_(world)
    return tensor


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
    """Send `send` to rank dst while receiving `recv` from rank src; return when both are done."""
    ops = [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
