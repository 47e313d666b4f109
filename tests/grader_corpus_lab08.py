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
    receives before it sends. "star": every rank sends to rank 0, which sends the sum back;
    "star_in_a_thread": the same from another thread. "stub": not implemented."""

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
        if mistake == "star_in_a_thread":  # out of sight of a watcher in the calling thread
            helper = threading.Thread(target=_star, args=(tensor, world, rank))
            helper.start()
            helper.join()
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
RING["star_in_a_thread"] = RING["star"]


def ddp(mistake: str = ""):
    """ "no_average": sums the gradients. "after_backward": every all-reduce in
    finish_gradient_synchronization (correct gradients, nothing overlapped). "synchronous": the
    hook's all-reduce without async_op. "no_broadcast": replicas keep their own initial weights.
    "per_parameter": one all-reduce per parameter whatever bucket_mb says. "never_reduced": waits
    on nothing, averages nothing. "dummy_overlap": asynchronous all-reduces of zeros from the
    gradient hooks, the gradients' all-reduces after backward."""

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
            self.pending, self.dummies = [], []
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
            if mistake == "dummy_overlap":  # something all-reduced during backward, not gradients
                self.dummies.append(dist.all_reduce(torch.zeros(16), async_op=True))
                return
            self.ready[self.bucket_of[param]] += 1
            while len(self.pending) < len(self.buckets):
                bucket = self.buckets[len(self.pending)]
                if self.ready[len(self.pending)] < len(bucket):
                    break
                self._launch(bucket)

        def finish_gradient_synchronization(self):
            if mistake == "never_reduced":
                return
            if mistake in ("after_backward", "dummy_overlap"):
                for work in self.dummies:
                    work.wait()
                for bucket in self.buckets:
                    self._launch(bucket)
            for bucket, flat, work in self.pending:
                if work is not None:
                    work.wait()
                if mistake != "no_average":
                    flat.div_(self.world)
                for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                    p.grad.copy_(g.view_as(p))
            self.pending, self.dummies, self.ready = [], [], [0] * len(self.buckets)

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
    "dummy_overlap": "N=2, bucket_mb=0.02: the 26 all-reduces started during backward (416 "
    "elements) hold none of this rank's gradients",
}


# ---- Attacks on the grader: each a whole solution cell, graded by `python -m grading` ------------
# Each adds up every rank's inputs without a message where a rank can reach them, or fakes the
# overlap; each was credited by the grader whose ranks were forked from the process that held every
# rank's inputs, and whose overlap was the ranks' own account.

_ADD_UP = '''
def _add_up(everyone, tensor, average):
    """Every rank's input of this case, found among `everyone` (per rank, per case), summed here."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if not (isinstance(everyone, (list, tuple)) and len(everyone) == world
            and all(isinstance(p, (list, tuple)) for p in everyone)):
        return False
    for k, t in enumerate(everyone[rank]):
        if (isinstance(t, torch.Tensor) and t.dtype == tensor.dtype and t.shape == tensor.shape
                and torch.equal(t, tensor)):
            total = sum(p[k].double() for p in everyone)
            tensor.copy_(total / world if average else total)
            return True
    return False
'''

READS_FRAMES = _ADD_UP + '''

def ring_all_reduce(tensor, average=False):
    """Walks up the callers' frames to a list of every rank's inputs."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if _add_up(frame.f_locals.get("inputs"), tensor, average):
            return tensor
        frame = frame.f_back
    return tensor
'''

READS_OBJECTS = _ADD_UP + '''

def ring_all_reduce(tensor, average=False):
    """Searches every object the garbage collector tracks for every rank's inputs."""
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, list) and _add_up(obj, tensor, average):
            return tensor
    return tensor
'''

READS_PROC = '''
def ring_all_reduce(tensor, average=False):
    """Reads the inputs the grader wrote for the ranks, through /proc: its own folder's and every
    visible process's (the parent's included)."""
    import glob
    import os

    world, rank = dist.get_world_size(), dist.get_rank()
    folders = ["/proc/self/cwd", f"/proc/{os.getppid()}/cwd", *glob.glob("/proc/[0-9]*/cwd")]
    for folder in folders:
        names = glob.glob(f"{folder}/*.pt") + glob.glob(f"{folder}/../*.pt")
        for name in sorted(names, key=os.path.getmtime, reverse=True):  # this group's: the last
            try:
                flat = torch.load(name, weights_only=True)
            except Exception:
                continue
            if not isinstance(flat, (list, tuple)) or len(flat) % world:
                continue
            n = len(flat) // world
            for k in range(n):
                same = [flat[r * n + k] for r in range(world)]
                if all(isinstance(t, torch.Tensor) and t.dtype == tensor.dtype
                       and t.shape == tensor.shape for t in same) and torch.equal(same[rank],
                                                                                  tensor):
                    total = sum(flat[r * n + k].double() for r in range(world))
                    tensor.copy_(total / world if average else total)
                    return tensor
    return tensor
'''

DUMMY_OVERLAP = '''
class BucketedDDP(nn.Module):
    """Dummy asynchronous all-reduces from gradient hooks, so that all-reduces seem to start
    during backward; the gradients' all-reduce, synchronous, after backward. (One bucket: the
    honest single all-reduce.)"""

    def __init__(self, module, bucket_mb=25.0):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.one_bucket = bucket_mb >= 100
        self.pending, self.seen = [], 0
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        self.seen += 1
        if self.one_bucket and self.seen == len(self.params):
            self.flat = torch.cat([p.grad.view(-1) for p in self.params])
            self.pending.append(dist.all_reduce(self.flat, async_op=True))
        elif not self.one_bucket and self.seen % 7 == 1:
            self.pending.append(dist.all_reduce(torch.zeros(16), async_op=True))

    def finish_gradient_synchronization(self):
        for work in self.pending:
            work.wait()
        halves = [self.params] if self.one_bucket else [self.params[:14], self.params[14:]]
        for group in halves:
            flat = self.flat if self.one_bucket else torch.cat([p.grad.view(-1) for p in group])
            if not self.one_bucket:
                dist.all_reduce(flat)
            flat.div_(self.world)
            for p, g in zip(group, flat.split([p.numel() for p in group])):
                p.grad.copy_(g.view_as(p))
        self.pending, self.seen = [], 0
'''

# folder: (the cells replaced by grade_id, what each function must get)
ATTACKS = {
    "reads_frames": (
        {"ring_all_reduce": READS_FRAMES, "BucketedDDP": DUMMY_OVERLAP},
        {"ring_all_reduce": "average=True, rank 0: the tensor is unchanged: nothing was reduced",
         "BucketedDDP": "N=2, bucket_mb=0.02: the 4 all-reduces started during backward (64 "
                        "elements) hold none of this rank's gradients"},
    ),
    "reads_objects": (
        {"ring_all_reduce": READS_OBJECTS},
        {"ring_all_reduce": "average=True, rank 0: the tensor is unchanged: nothing was reduced"},
    ),
    "reads_proc": (
        {"ring_all_reduce": READS_PROC},
        {"ring_all_reduce": "average=True, rank 0: the tensor is unchanged: nothing was reduced"},
    ),
}
