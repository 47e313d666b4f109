"""The ring all-reduce of `ring.py`, pipelined: each chunk travels as segments, and a segment moves
on to the next step as soon as it has arrived (and, in the reduce-scatter, been added), while the
segments behind it are still on the wire.

`ring.py` runs 2 (N - 1) steps one after the other: a step's add starts only when its whole chunk
has arrived, and the next step's send only when the add is done, so the link idles during every
add and the adds wait for the whole transfer. Here the chunk received at step s is exactly the
chunk sent at step s + 1 (reduce-scatter and all-gather alike: `ring.py`'s indices), so segment k
can go on as soon as its own add is done:

    step s, segment k:   recv (s, k) lands -> add it into the chunk -> post send (s + 1, k)
                                                                      and recv (s + 1, k)

One more cost of `ring.py` is removed: its receive buffer is allocated on every call, a fresh S / N
bytes that the operating system maps page by page on first touch (8192 page faults of 4 KiB per
call at 64 MiB on 2 ranks). Here one buffer is kept between calls; segment k of step s + 1 reuses
segment k's slot, which step s has finished adding by then.

Every (step, segment) message has its own tag, so no receive can match the wrong send whatever
order the transport delivers them in; each send is posted together with its receive
(`batch_isend_irecv`), which NCCL needs (a lone send around a ring would wait for a receive posted
behind it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEGMENT_BYTES = 4 * 2**20  # per message: long enough that alpha (~40 us) is < 2% of it at ~1 GB/s
_inboxes: dict[tuple, torch.Tensor] = {}  # (dtype, device, elements) -> the receive buffer


def _receive_buffer(like: torch.Tensor) -> torch.Tensor:
    """A receive buffer of like's size, dtype and device, kept between calls."""
    key = (like.dtype, like.device, like.numel())
    if key not in _inboxes:
        _inboxes.clear()  # one size at a time: the cache never holds more than one chunk
        _inboxes[key] = torch.empty_like(like)
    return _inboxes[key]


def pipelined_ring_all_reduce(
    tensor: torch.Tensor, average: bool = False, segment_bytes: int = SEGMENT_BYTES
) -> torch.Tensor:
    """Sum (or average) `tensor` across the ranks of the default process group, in place; returns
    `tensor`. The same result as `ring.ring_all_reduce` (the same additions in the same order)."""
    if not tensor.is_contiguous():
        raise ValueError(
            "pipelined_ring_all_reduce works in place on a contiguous tensor; pass x.contiguous()"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    chunks = tensor.view(-1).tensor_split(world)  # views; the first are the longest
    right, left = (rank + 1) % world, (rank - 1) % world
    segments = max(1, -(-chunks[0].numel() * tensor.element_size() // segment_bytes))
    pieces = [chunk.tensor_split(segments) for chunk in chunks]
    inbox = _receive_buffer(chunks[0]).tensor_split(segments)
    steps = 2 * (world - 1)  # reduce-scatter steps, then all-gather steps

    def post(step, k):
        """Send segment k of this step's chunk; receive the left neighbour's (the reduce-scatter
        into the inbox, to add it; the all-gather straight into the chunk)."""
        # ring.py's indices, counting the all-gather's steps on from the reduce-scatter's: at
        # step s rank r sends chunk r - s and receives chunk r - s - 1 (mod N)
        incoming = pieces[(rank - step - 1) % world][k]
        target = inbox[k][: incoming.numel()] if step < world - 1 else incoming
        tag = step * segments + k
        ops = [
            dist.P2POp(dist.isend, pieces[(rank - step) % world][k], right, tag=tag),
            dist.P2POp(dist.irecv, target, left, tag=tag),
        ]
        return dist.batch_isend_irecv(ops), target

    pending = [post(0, k) for k in range(segments)]  # step 0: every segment at once
    for step in range(steps):
        for k in range(segments):
            requests, received = pending[k]
            for request in requests:
                request.wait()
            if step < world - 1:  # reduce-scatter: add the neighbour's partial sum into ours
                pieces[(rank - step - 1) % world][k].add_(received)
            if step + 1 < steps:  # the segment moves on while the ones behind it still arrive
                pending[k] = post(step + 1, k)
    if average:
        tensor.div_(world)
    return tensor
