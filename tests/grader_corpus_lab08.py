"""Known-wrong submissions for lab 08 (a ring all-reduce, a bucketed overlapping DDP), and what the
checks must say about each.

Each is the lab's solution with one mistake a student makes. The check cells' ranks are forked, so
these closures run in them as they are."""

import threading

import torch
import torch.distributed as dist
from torch import nn


def _exchange(send, dst, recv, src):
    ops = [dist.P2POp(dist.isend, send, dst), dist.P2POp(dist.irecv, recv, src)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def _star(tensor, world: int, rank: int) -> None:
    """Rank 0 receives every rank's tensor, sums and sends the sum back: right values, sends and
    receives only, and not a ring (rank 0 moves N - 1 whole tensors each way)."""
    if rank:
        dist.send(tensor, 0)
        dist.recv(tensor, 0)
        return
    inbox = torch.empty_like(tensor)
    for peer in range(1, world):
        dist.recv(inbox, peer)
        tensor.add_(inbox)
    for peer in range(1, world):
        dist.send(tensor, peer)


def ring(mistake: str = ""):
    """ "partial_chunks": the reduce-scatter stops one step early, so each chunk sums only N - 1
    ranks. "skips_last_chunk": the all-gather stops one step early, so one chunk per rank is never
    received. "no_average": average=True is ignored. "uses_all_reduce": the answer from the
    collective. "uses_process_group": the collective through the ProcessGroup object, around
    `dist.all_reduce`. "uses_a_thread": the collective, called from another thread.
    "not_in_place": returns a new tensor. "divisible_only": assumes N divides the size.
    "float32_inbox": receives into a float32 buffer whatever the dtype. "deadlock": every rank
    receives before it sends. "star": every rank sends to rank 0, which sends the sum back.
    "stub": not implemented."""

    def ring_all_reduce(tensor, average=False):
        if mistake == "stub":
            raise NotImplementedError()
        if mistake == "uses_all_reduce":
            dist.all_reduce(tensor)
            return tensor.div_(dist.get_world_size()) if average else tensor
        if mistake == "uses_process_group":
            dist.group.WORLD.allreduce([tensor]).wait()
            return tensor.div_(dist.get_world_size()) if average else tensor
        if mistake == "uses_a_thread":
            helper = threading.Thread(target=dist.all_reduce, args=(tensor,))
            helper.start()
            helper.join()
            return tensor.div_(dist.get_world_size()) if average else tensor
        world, rank = dist.get_world_size(), dist.get_rank()
        if mistake == "star":
            _star(tensor, world, rank)
            return tensor.div_(world) if average else tensor
        right, left = (rank + 1) % world, (rank - 1) % world
        if mistake == "deadlock":
            dist.recv(torch.empty_like(tensor), left)
        if mistake == "divisible_only":
            chunks = list(tensor.view(world, -1))
        else:
            chunks = tensor.view(-1).tensor_split(world)
        if mistake == "float32_inbox":
            inbox = torch.empty(chunks[0].numel())
        else:
            inbox = torch.empty_like(chunks[0])
        steps = world - 2 if mistake == "partial_chunks" else world - 1
        for step in range(steps):
            recv = chunks[(rank - step - 1) % world]
            _exchange(chunks[(rank - step) % world], right, inbox[: recv.numel()], left)
            recv.add_(inbox[: recv.numel()])
        steps = world - 2 if mistake == "skips_last_chunk" else world - 1
        for step in range(steps):
            _exchange(chunks[(rank + 1 - step) % world], right, chunks[(rank - step) % world], left)
        if average and mistake != "no_average":
            tensor.div_(world)
        return tensor.clone() if mistake == "not_in_place" else tensor

    return ring_all_reduce


# what the ring check must say (the first problem: the world sizes are checked in order, N = 2
# first; the cases every shape in every dtype, average=True on every other one)
RING = {
    "partial_chunks": "N=2, shape (1,) float32, average=True, rank 0: max error",
    "skips_last_chunk": "N=2, shape (1,) float32, average=True, rank 0: max error",
    "no_average": "N=2, shape (1,) float32, average=True, rank 0: returned the sum, not the "
    "average: divide by the world size",
    "uses_all_reduce": "N=2, shape (0,) float32: uses the library collective dist.all_reduce "
    "(the grader's relay saw rank 0 call it): build the ring from sends and receives",
    "uses_process_group": "N=2, shape (0,) float32: uses the library collective dist.all_reduce",
    # the relay sees every thread's messages: the same verdict as the call from this thread
    "uses_a_thread": "N=2, shape (0,) float32: uses the library collective dist.all_reduce",
    "not_in_place": "N=2, shape (0,) float32: must reduce in place and return its argument (it "
    "returned another tensor)",
    "divisible_only": "N=2, shape (1,) float32, average=True: raised RuntimeError: shape '[2, -1]' "
    "is invalid for input of size 1",
    # the relay compares each message with the buffer that receives it, empty ones too
    "float32_inbox": "N=2, shape (0,) float64, average=True: raised RuntimeError: rank 0 received "
    "0 torch.float64 elements from rank 1 into a buffer of 0 torch.float32",
    "deadlock": "N=2: every rank waits for a message that never comes",
}
RING_ALSO = {  # more of the same message
    "partial_chunks": "chunks [0] of 2 are wrong",
    "skips_last_chunk": "chunks [0] of 2 are wrong",
    "float32_inbox": "do a send and its receive disagree in size or dtype?",
}
RING["star"] = "N=3, shape (0,) float32: rank 0 sent to ranks [1, 2] and received from [1, 2]"


def ddp(mistake: str = ""):
    """ "no_average": sums the gradients. "after_backward": every all-reduce in
    finish_gradient_synchronization (correct gradients, nothing overlapped). "synchronous": the
    hook's all-reduce without async_op. "no_broadcast": replicas keep their own initial weights.
    "per_parameter": one all-reduce per parameter whatever bucket_mb says. "never_reduced": waits
    on nothing, averages nothing."""

    class BucketedDDP(nn.Module):
        def __init__(self, module, bucket_mb=25.0):
            super().__init__()
            self.module = module
            self.world = dist.get_world_size()
            if mistake != "no_broadcast":
                with torch.no_grad():
                    for p in module.parameters():
                        dist.broadcast(p, src=0)
            params = [p for p in module.parameters() if p.requires_grad][::-1]
            limit = 0.0 if mistake == "per_parameter" else bucket_mb * 2**20
            self.buckets, current, size = [], [], 0
            for p in params:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= limit:
                    self.buckets.append(current)
                    current, size = [], 0
            if current:
                self.buckets.append(current)
            self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b}
            self.ready = [0] * len(self.buckets)
            self.pending = []
            if mistake not in ("after_backward", "never_reduced"):
                for p in params:
                    p.register_post_accumulate_grad_hook(self._grad_ready)

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def _launch(self, bucket):
            flat = torch.cat([p.grad.view(-1) for p in bucket])
            work = dist.all_reduce(flat, async_op=mistake != "synchronous")
            self.pending.append((bucket, flat, work))

        def _grad_ready(self, param):
            self.ready[self.bucket_of[param]] += 1
            while len(self.pending) < len(self.buckets):
                bucket = self.buckets[len(self.pending)]
                if self.ready[len(self.pending)] < len(bucket):
                    break
                self._launch(bucket)

        def finish_gradient_synchronization(self):
            if mistake == "never_reduced":
                return
            if mistake == "after_backward":
                for bucket in self.buckets:
                    self._launch(bucket)
            for bucket, flat, work in self.pending:
                if work is not None:
                    work.wait()
                if mistake != "no_average":
                    flat.div_(self.world)
                for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                    p.grad.copy_(g.view_as(p))
            self.pending, self.ready = [], [0] * len(self.buckets)

    return BucketedDDP


DDP = {
    "no_average": "is the sum over the ranks, 2x the average: divide by the world size",
    "after_backward": "N=2, bucket_mb=0.02: every all-reduce started after backward returned: "
    "nothing overlaps it",
    "synchronous": "N=2, bucket_mb=0.02: an all-reduce inside backward is synchronous (no "
    "async_op=True)",
    "no_broadcast": "N=2, bucket_mb=0.02: the replicas do not start from rank 0's weights "
    "(rank 1's differ after __init__): broadcast every parameter from rank 0 in __init__",
    "per_parameter": "N=2, bucket_mb=0.02: 28 all-reduces per step for 28 parameters in buckets "
    "of 0.02 MiB: expected more than one and fewer than one per parameter",
    "never_reduced": "is this rank's own gradient: it was never all-reduced",
}
