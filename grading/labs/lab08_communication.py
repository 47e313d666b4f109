"""Lab 08: a ring all-reduce from sends and receives, and data parallelism that overlaps the
gradient all-reduce with the backward pass.

Neither is a kernel the harness can call on one tensor: each runs in a process group. Grading one
is two halves, apart:

* `run_ring` / `run_ddp` start a gloo process group of CPU processes (`kernels.communication.
  launch`, forked, so functions defined in a notebook run as they are), give each rank its own
  inputs, call the student's code there, and return what each rank produced: output tensors,
  gradients, which collectives it called. They make no verdict. `python -m grading` runs them in
  its sandboxed worker (the `run_group` of each `GradedFunction`; the sandbox keeps loopback, on
  which the group meets).
* `grade_ring` / `grade_ddp` make the inputs from the seed, have them run (`call`), and judge
  what came back against references computed where the verdict is made: the float64 sum of the
  ranks' inputs (what `dist.all_reduce` computes), and single-process training of the same GPT on
  the whole batch. In `python -m grading` that is the grader's own process; the seed never enters
  the worker.

The lab's check cells (`check_ring_all_reduce`, `check_data_parallel`) run both halves in the
notebook's process with seed 0, and print one PASS or FAIL line per process group with the reason.

Not defended: the ranks are forked from one process that holds every rank's inputs (the worker,
which also runs the launcher), so code that searches its memory, or replaces the launcher, could
add the ranks' inputs up without a message; what comes back is still judged against the grader's
own references.
"""

from __future__ import annotations

import copy
import io
import random
import re
import traceback
import warnings

import torch
import torch.distributed as dist
from torch._C._profiler import _ExperimentalConfig
from torch.utils._python_dispatch import TorchDispatchMode

from grading.harness import function_kind
from grading.results import CaseResult, FunctionResult
from grading.spec import GradedFunction, LabSpec
from grading.watch import quiet_stderr
from kernels.communication import launch
from kernels.memory_profiling import gpt

WORLDS = (2, 3)  # an even and an odd number of ranks; sizes below are not multiples of either
TIMEOUT_S = 20.0  # per process group: a rank waiting for a message that never comes
RING_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Empty, smaller than the world (empty chunks), odd, and a 2-D tensor; two more drawn per seed.
RING_SHAPES = ((0,), (1,), (2,), (7,), (1001,), (37, 29))
CFG = gpt.GPTConfig(vocab=97, max_seq=16, d_model=32, layers=2, heads=4)
BATCH, SEQ, STEPS = 4, 16, 2
SMALL_BUCKET_MB = 0.02  # about 5 of the tiny GPT's 8k-float blocks per bucket; 100 MiB: one bucket
DDP_BUCKETS = (SMALL_BUCKET_MB, 100.0)
# What the process group's ops are called in `torch.distributed`: a ring built from sends and
# receives dispatches only c10d.send and c10d.recv_.
LIBRARY_COLLECTIVES = {
    "c10d.allreduce_.default": "dist.all_reduce",
    "c10d.allreduce_coalesced_.default": "dist.all_reduce_coalesced",
    "c10d.reduce_.default": "dist.reduce",
    "c10d.broadcast_.default": "dist.broadcast",
    "c10d.allgather_.default": "dist.all_gather",
    "c10d._allgather_base_.default": "dist.all_gather_into_tensor",
    "c10d.allgather_into_tensor_coalesced_.default": "dist.all_gather_into_tensor",
    "c10d.reduce_scatter_.default": "dist.reduce_scatter",
    "c10d._reduce_scatter_base_.default": "dist.reduce_scatter_tensor",
    "c10d.reduce_scatter_tensor_coalesced_.default": "dist.reduce_scatter_tensor",
    "c10d.alltoall_.default": "dist.all_to_all",
    "c10d.alltoall_base_.default": "dist.all_to_all_single",
    "c10d.gather_.default": "dist.gather",
    "c10d.scatter_.default": "dist.scatter",
}
POINT_TO_POINT = {"c10d.send.default", "c10d.recv_.default", "c10d.recv_any_source_.default"}


class _CollectiveWatch(TorchDispatchMode):
    """Records the process-group operations a call dispatches, other than sends and receives:
    every path to the process group (`dist.all_reduce`, `distributed_c10d`, the `ProcessGroup`
    object) dispatches one of these ops; and the ranks it sent to and received from (-1: any)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.sent_to: set[int] = set()
        self.received_from: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name == "c10d.send.default":
            self.sent_to.add(int(args[2]))
        elif name == "c10d.recv_.default":
            self.received_from.add(int(args[2]))
        elif name == "c10d.recv_any_source_.default":
            self.received_from.add(-1)
        elif name.startswith("c10d.") and name not in self.ops:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _AllThreadsWatch:
    """The process-group operations every thread of this process ran inside the block, other than
    sends and receives (PyTorch's profiler, all threads): a collective called from another thread,
    which the dispatch mode above (this thread's only) cannot see."""

    def __enter__(self):
        self.ops: list[str] = []
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        )
        # quiet: the profiler's notes would land in the student's check cell
        with quiet_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        with quiet_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.profiler.__exit__(*exc)
        for event in self.profiler.events():
            name = "c10d." + event.name.removeprefix("c10d::") + ".default"
            if event.name.startswith("c10d::") and name not in POINT_TO_POINT:
                if name not in self.ops:
                    self.ops.append(name)


class _RankFailed(Exception):
    """A rank's call raised: the message names the case and the exception."""


def _raised(label: str, exc: BaseException) -> _RankFailed:
    """The exception of a student's call, with the line of the student's code it came from."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and "site-packages" not in f.filename
    ]
    where = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return _RankFailed(f"{label}: raised {type(exc).__name__}: {exc}{where}")


def _as_bytes(obj) -> bytes:
    """A rank's results as `torch.save` bytes: tensors by value (torch.multiprocessing would hand
    them over as shared memory, which dies with the rank), read back as data only."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _peer_gone(message: str) -> bool:
    """A rank that failed because another one did (its peer closed the connection)."""
    return any(s in message for s in ("Connection closed by peer", "Connection reset", "gloo/"))


# What a forked rank raises when this process ran a backward pass first with a GPU present:
# autograd's device threads do not survive a fork.
AUTOGRAD_FORK = "autograd's threading in combination with fork-based multiprocessing"


def _launch(worker, world: int, args: tuple) -> dict:
    """worker in a gloo group of `world` forked processes: {"ranks": results} or {"error": why}.
    A NotImplementedError in any rank is raised here. One torch thread per rank: GNU OpenMP is
    not fork-safe, and a rank that starts a parallel region after this process has used the pool
    hangs (seen on a 16-core host)."""
    try:
        packed = launch.run(
            worker, world, args, backend="gloo", timeout_s=TIMEOUT_S, start_method="fork",
            threads=1,
        )
    except TimeoutError:
        return {
            "error": f"N={world}: did not finish within {TIMEOUT_S:.0f} s: a receive whose send "
            "never comes, or a collective not every rank calls? (do the steps of every rank pair "
            "up?)"
        }
    except RuntimeError as exc:
        text = str(exc)
        if "NotImplementedError" in text:
            raise NotImplementedError from None
        if AUTOGRAD_FORK in text:
            return {
                "error": f"N={world}: the ranks could not run backward: this process ran a "
                "backward pass before forking them, and with a GPU present autograd's threads do "
                "not survive a fork. Restart the kernel and run this check before any backward "
                "(or grade with python -m grading, whose worker never runs one)"
            }
        raised = [
            line.split("_RankFailed: ", 1)[1]
            for line in text.splitlines()
            if "_RankFailed: " in line
        ]
        died = re.findall(r"rank (\d+) of \d+ (?:died|failed:\nexited with code)", text)
        if raised and died and all(_peer_gone(r) for r in raised):
            # gloo ends the process (a C++ abort) whose receive gets a message of another size
            return {
                "error": f"{raised[0].split(': raised', 1)[0]}: rank {died[0]} of {world} died "
                "inside gloo and the others lost their connection: do a send and its receive "
                "disagree in size or dtype?"
            }
        if raised:  # a rank's call raised: its case and exception; the cause before its symptoms
            return {"error": sorted(raised, key=_peer_gone)[0]}
        last = [line.strip() for line in text.strip().splitlines() if line.strip()][-1:]
        return {"error": f"N={world}: raised {last[0] if last else text}"}
    try:
        return {"ranks": [torch.load(io.BytesIO(p), weights_only=True) for p in packed]}
    except Exception as exc:  # noqa: BLE001 - whatever a rank sent back, it is not its results
        return {"error": f"N={world}: a rank's results could not be read ({type(exc).__name__})"}


def _label(world, shape, dtype, average) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"N={world}, shape {tuple(shape)} {name}" + (", average=True" if average else "")


# --------------------------------------------------------------------------------------------------
# Part 1: ring_all_reduce(tensor, average=False)


def ring_cases(seed: int, world: int) -> list[dict]:
    """Every shape in every dtype, average=True on every other one; two sizes drawn per seed: an
    odd size and one above 2**16, neither a multiple of the world size."""
    rng = random.Random(f"ring {seed} {world}")
    drawn = []
    for low, high in ((11, 997), (2**16, 2**17)):
        n = rng.randrange(low, high) | 1
        drawn.append((n + (n % world == 0) * 2,))
    shapes = [*RING_SHAPES, *drawn]
    cases = []
    for shape in shapes:
        for dtype in RING_DTYPES:
            cases.append(
                {
                    "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                    "average": len(cases) % 2 == 1,
                }
            )
    return cases


def ring_inputs(seed: int, world: int, cases: list[dict]) -> list[list[torch.Tensor]]:
    """Per rank, per case: random values, a different magnitude per case, different on every
    rank."""
    g = torch.Generator().manual_seed(random.Random(f"ring inputs {seed} {world}").getrandbits(62))
    out = [[] for _ in range(world)]
    for case in cases:
        scale = 10.0 ** int(torch.randint(-2, 3, (), generator=g))
        for rank in range(world):
            x = torch.randn(case["shape"], generator=g, dtype=torch.float64) * scale
            out[rank].append(x.to(getattr(torch, case["dtype"])))
    return out


def _ring_rank(rank, world, fn, cases, inputs):
    """In each rank: fn on this rank's input of every case, in order; what it left and returned."""
    mine, out = inputs[rank], []
    with _AllThreadsWatch() as threads:
        for case, x in zip(cases, mine):
            tensor = x.clone()
            label = _label(world, case["shape"], case["dtype"], case["average"])
            with _CollectiveWatch() as seen:
                try:
                    returned = fn(tensor, average=True) if case["average"] else fn(tensor)
                except NotImplementedError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the student's error, with its case
                    raise _raised(label, exc) from None
            out.append(
                {
                    "output": tensor.detach().clone(),
                    "in_place": returned is tensor,
                    "returned": type(returned).__name__,
                    "collectives": list(seen.ops),
                    "sent_to": sorted(seen.sent_to),
                    "received_from": sorted(seen.received_from),
                }
            )
    return _as_bytes({"cases": out, "all_threads": threads.ops})


def run_ring(fn, job: dict, inputs: tuple) -> dict:
    """Runs where the student's code runs: `job` = {"world", "cases"}; `inputs` rank-major (every
    case of rank 0, then rank 1, ...). Returns {"ranks": [per rank, per case: dict]} or
    {"error": why}."""
    world, cases = int(job["world"]), list(job["cases"])
    per_rank = [list(inputs[r * len(cases) : (r + 1) * len(cases)]) for r in range(world)]
    return _launch(_ring_rank, world, (fn, cases, per_rank))


def _chunk_report(bad: torch.Tensor, world: int) -> str:
    """Which of the ring's chunks hold wrong elements."""
    wrong = [i for i, c in enumerate(bad.reshape(-1).tensor_split(world)) if c.any()]
    return f"chunks {wrong} of {world} are wrong" if wrong else ""


def _is_tensor(x) -> bool:
    return type(x) is torch.Tensor


def _well_formed_ring(found, world: int, n_cases: int) -> bool:
    if not isinstance(found, dict):
        return False
    if "error" in found:
        return isinstance(found["error"], str)
    ranks = found.get("ranks")
    return (
        isinstance(ranks, list)
        and len(ranks) == world
        and all(
            isinstance(r, dict)
            and _strings(r.get("all_threads"))
            and isinstance(r.get("cases"), list)
            and len(r["cases"]) == n_cases
            for r in ranks
        )
        and all(
            isinstance(c, dict)
            and _is_tensor(c.get("output"))
            and isinstance(c.get("in_place"), bool)
            and isinstance(c.get("returned"), str)
            and _strings(c.get("collectives"))
            and _ints(c.get("sent_to"))
            and _ints(c.get("received_from"))
            for r in ranks
            for c in r["cases"]
        )
    )


def _strings(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def _ints(x) -> bool:
    return isinstance(x, list) and all(type(i) is int for i in x)


def _not_a_ring(rank: int, world: int, sent_to: list[int], received_from: list[int]) -> str:
    """Why one rank's sends and receives are not a ring's ("" if they are): a ring sends only to
    one neighbour and receives only from the other (either way round)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    sent, received = set(sent_to), set(received_from)
    if (sent <= {right} and received <= {left}) or (sent <= {left} and received <= {right}):
        return ""
    return (f"rank {rank} sent to ranks {sorted(sent)} and received from {sorted(received)} "
            f"(-1: any): a ring sends only to its next rank and receives only from the one "
            f"before it (a star or an all-to-all is not a ring)")


def _library(ops: list[str]) -> str:
    return ", ".join(sorted({LIBRARY_COLLECTIVES.get(op, op) for op in ops}))


def judge_ring(world: int, cases: list[dict], inputs, found) -> str:
    """What is wrong with one process group's results ("" if nothing), against the float64 sum of
    the ranks' inputs: each addition may round once in the tensor's dtype."""
    if not _well_formed_ring(found, world, len(cases)):
        return f"N={world}: the ranks' results could not be read (not what the call returns)"
    if "error" in found:
        return found["error"]
    ranks = [r["cases"] for r in found["ranks"]]
    for k, case in enumerate(cases):
        dtype, average = getattr(torch, case["dtype"]), case["average"]
        label = _label(world, case["shape"], case["dtype"], average)
        xs = [inputs[r][k].double() for r in range(world)]
        total = torch.stack(xs).sum(0) if xs[0].numel() else xs[0].clone()
        want = total / world if average else total
        # world - 1 additions and a division, each rounding by at most eps / 2 of what it makes
        magnitude = torch.stack(xs).abs().sum(0) / (world if average else 1)
        allowed = (world + 1) * torch.finfo(dtype).eps * magnitude + torch.finfo(dtype).tiny
        for rank, got in enumerate(ranks):
            c = got[k]
            if c["collectives"]:
                return (
                    f"{label}: uses the library collective {_library(c['collectives'])} "
                    f"({', '.join(c['collectives'])}): build the ring from sends and receives"
                )
            not_a_ring = _not_a_ring(rank, world, c["sent_to"], c["received_from"])
            if not_a_ring:
                return f"{label}: {not_a_ring}"
            if not c["in_place"]:
                return (
                    f"{label}: must reduce in place and return its argument (it returned "
                    f"{'another tensor' if c['returned'] == 'Tensor' else c['returned']})"
                )
            out = c["output"]
            if out.dtype != dtype or list(out.shape) != list(case["shape"]):
                return f"{label}: the tensor's dtype or shape changed"
            err = (out.double() - want).abs()
            bad = err.isnan() | (err > allowed)
            if not bad.any():
                continue
            where = f"{label}, rank {rank}"
            if average and ((out.double() - total).abs() <= allowed * world).all():
                return f"{where}: returned the sum, not the average: divide by the world size"
            if torch.equal(out, inputs[rank][k]):
                return f"{where}: the tensor is unchanged: nothing was reduced"
            chunks = _chunk_report(bad, world)
            worst = err.nan_to_num(float("inf")).max().item()
            return (
                f"{where}: max error {worst:.3g} where rounding allows "
                f"{allowed.reshape(-1)[err.reshape(-1).nan_to_num(float('inf')).argmax()]:.3g}"
                + (f"; {chunks}" if chunks else "")
            )
    for rank, r in enumerate(found["ranks"]):
        if r["all_threads"]:
            return (
                f"N={world}, rank {rank}: uses the library collective {_library(r['all_threads'])} "
                f"({', '.join(r['all_threads'])}) outside the calling thread: build the ring from "
                "sends and receives"
            )
    return ""


def grade_ring(spec, kind, call, seed: int, step=None) -> FunctionResult:
    """Grade a ring all-reduce: one process group per world size, `call(job, inputs)` running it
    (in this process, or in the grader's worker) and returning what `run_ring` returns."""
    result = _result(spec, seed)
    if not _callable(result, kind, spec.name):
        return result
    for world in WORLDS:
        cases = ring_cases(seed, world)
        inputs = ring_inputs(seed, world, cases)
        if step is not None:
            step(spec.name, f"N={world}: {len(cases)} tensors", "call")
        flat = tuple(t for per_rank in inputs for t in per_rank)
        try:
            found = call({"world": world, "cases": cases}, flat)
        except NotImplementedError:
            result.status, result.message, result.cases = (
                "not implemented",
                "not implemented yet",
                [],
            )
            return result
        problem = judge_ring(world, cases, inputs, found)
        result.cases.append(CaseResult(f"N={world}: {len(cases)} tensors", not problem, problem))
        if problem:
            result.message = problem
            return result
    result.status, result.points = "pass", spec.points
    return result


# --------------------------------------------------------------------------------------------------
# Part 2: BucketedDDP(module, bucket_mb)


def ddp_inputs(seed: int, world: int) -> tuple[list, list, list]:
    """(initial weights per rank, batches, parameter names): rank 0's weights are the GPT's
    initialization from the seed; the other ranks' differ (the wrapper must broadcast rank 0's)."""
    rng = random.Random(f"ddp {seed}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.getrandbits(62))
        model = gpt.GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    first = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    weights = [first] + [
        [w + torch.randn(w.shape, generator=g) for w in first] for _ in range(world - 1)
    ]
    batches = [
        gpt.make_batch(CFG, BATCH, SEQ, "cpu", seed=rng.getrandbits(31)) for _ in range(STEPS)
    ]
    return weights, batches, names


def _rows(rank: int, world: int) -> slice:
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def _ddp_rank(rank, world, cls, buckets, weights, batches):
    """In each rank: for each bucket size, the GPT with this rank's weights wrapped in cls, STEPS
    SGD steps on this rank's rows; the weights after __init__, and per step the all-reduces
    started (during backward?, async_op?, elements) and the gradients after
    finish_gradient_synchronization()."""
    original, phase, calls = dist.all_reduce, {"backward": False}, []

    def recording(tensor, *args, **kwargs):
        calls.append((phase["backward"], bool(kwargs.get("async_op", False)), tensor.numel()))
        return original(tensor, *args, **kwargs)

    out = []
    dist.all_reduce = recording  # the wrapper must call it as dist.all_reduce (the lab says so)
    try:
        for bucket_mb in buckets:
            label = f"N={world}, bucket_mb={bucket_mb}"
            model = gpt.GPT(CFG)
            with torch.no_grad():
                for p, w in zip(model.parameters(), weights[rank]):
                    p.copy_(w)
            try:
                wrapped = cls(model, bucket_mb=bucket_mb)
            except NotImplementedError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise _raised(f"{label}: __init__", exc) from None
            report = {"start": [p.detach().clone() for p in model.parameters()], "steps": []}
            for idx, targets in batches:
                calls.clear()
                try:
                    phase["backward"] = True
                    wrapped(idx[_rows(rank, world)], targets[_rows(rank, world)]).backward()
                    phase["backward"] = False
                    wrapped.finish_gradient_synchronization()
                except NotImplementedError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise _raised(label, exc) from None
                grads = [
                    None if p.grad is None else p.grad.detach().clone() for p in model.parameters()
                ]
                report["steps"].append({"calls": list(calls), "grads": grads})
                with torch.no_grad():  # SGD on this replica, with its own (averaged) gradients
                    for p in model.parameters():
                        if p.grad is not None:
                            p.sub_(0.5 * p.grad)
                        p.grad = None
            out.append(report)
    finally:
        dist.all_reduce = original
    return _as_bytes(out)


def run_ddp(cls, job: dict, inputs: tuple) -> dict:
    """Runs where the student's code runs: `job` = {"world", "buckets", "params", "steps"};
    `inputs`: every rank's weights (rank-major), then each step's (idx, targets)."""
    world, n, steps = int(job["world"]), int(job["params"]), int(job["steps"])
    weights = [list(inputs[r * n : (r + 1) * n]) for r in range(world)]
    rest = inputs[world * n :]
    batches = [(rest[2 * s], rest[2 * s + 1]) for s in range(steps)]
    return _launch(_ddp_rank, world, (cls, list(job["buckets"]), weights, batches))


def _reference_rank(rank: int, world: int, weights0: list, batches: list, ranks: int) -> bytes:
    return _as_bytes(ddp_reference(weights0, batches, ranks))


def ddp_reference_forked(weights0: list, batches: list, world: int):
    """`ddp_reference` in a process of its own: a backward pass in this process would start
    autograd's device threads (with a GPU present), and ranks forked after it could not run
    backward -- a check cell run twice would fail the second time. `launch.run` forks it without
    a GPU (milliseconds) and spawns it with one, since this process may have run a backward
    already (an earlier lab's judge in `python -m grading`, a notebook cell), and then no fork
    could."""
    [packed] = launch.run(_reference_rank, 1, (weights0, batches, world), backend="gloo",
                          timeout_s=TIMEOUT_S * 3, threads=1)
    return torch.load(io.BytesIO(packed), weights_only=True)


def ddp_reference(weights0: list, batches: list, world: int):
    """Single-process training on the whole batch from rank 0's weights: per step, the gradients
    (what every replica must hold after finish_gradient_synchronization) and each rank's own
    gradient on its rows (what an all-reduce that never happened leaves)."""
    model = gpt.GPT(CFG)
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights0):
            p.copy_(w)
    out = []
    for idx, targets in batches:
        local = []
        for rank in range(world):
            replica = copy.deepcopy(model)
            replica(idx[_rows(rank, world)], targets[_rows(rank, world)]).backward()
            local.append([p.grad.clone() for p in replica.parameters()])
        model(idx, targets).backward()
        out.append(([p.grad.clone() for p in model.parameters()], local))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.5 * p.grad)
                p.grad = None
    return out


def _close(a, b) -> bool:
    return _is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _well_formed_ddp(found, world: int, n_buckets: int, n_params: int) -> bool:
    if not isinstance(found, dict):
        return False
    if "error" in found:
        return isinstance(found["error"], str)
    ranks = found.get("ranks")

    def report_ok(r):
        return (
            isinstance(r, dict)
            and isinstance(r.get("start"), list)
            and len(r["start"]) == n_params
            and all(_is_tensor(t) for t in r["start"])
            and isinstance(r.get("steps"), list)
            and len(r["steps"]) == STEPS
            and all(
                isinstance(s, dict)
                and isinstance(s.get("grads"), list)
                and len(s["grads"]) == n_params
                and all(g is None or _is_tensor(g) for g in s["grads"])
                and isinstance(s.get("calls"), list)
                and all(
                    isinstance(c, (list, tuple))
                    and len(c) == 3
                    and isinstance(c[0], bool)
                    and isinstance(c[1], bool)
                    and isinstance(c[2], int)
                    for c in s["calls"]
                )
                for s in r["steps"]
            )
        )

    return (
        isinstance(ranks, list)
        and len(ranks) == world
        and all(isinstance(r, list) and len(r) == n_buckets for r in ranks)
        and all(report_ok(rep) for r in ranks for rep in r)
    )


def judge_ddp(world: int, buckets, weights, batches, names, found) -> str:
    """What is wrong with one process group's data-parallel training ("" if nothing)."""
    if not _well_formed_ddp(found, world, len(buckets), len(names)):
        return f"N={world}: the ranks' results could not be read (not what the call returns)"
    if "error" in found:
        return found["error"]
    reference = ddp_reference_forked(weights[0], batches, world)
    n_params = len(names)
    for b, bucket_mb in enumerate(buckets):
        label = f"N={world}, bucket_mb={bucket_mb}"
        for rank, per_bucket in enumerate(found["ranks"]):
            if not all(_close(s, w) for s, w in zip(per_bucket[b]["start"], weights[0])):
                return (
                    f"{label}: the replicas do not start from rank 0's weights (rank {rank}'s "
                    "differ after __init__): broadcast every parameter from rank 0 in __init__"
                )
        for rank, per_bucket in enumerate(found["ranks"]):
            report = per_bucket[b]
            for step, (s, (want, local)) in enumerate(zip(report["steps"], reference)):
                bad = [i for i in range(n_params) if not _close(s["grads"][i], want[i])]
                if bad:
                    i = bad[0]
                    g = s["grads"][i]
                    if g is None:
                        why = "has no gradient after finish_gradient_synchronization()"
                    elif _close(g, world * want[i]):
                        why = (
                            f"is the sum over the ranks, {world}x the average: divide by the "
                            "world size"
                        )
                    elif _close(g, local[rank][i]):
                        why = "is this rank's own gradient: it was never all-reduced"
                    else:
                        err = (g - want[i]).abs().max().item() if g.shape == want[i].shape else 0
                        why = f"differs from single-process training by up to {err:.3g}"
                    return (
                        f"{label}, step {step}, rank {rank}: the gradient of {names[i]} {why} "
                        f"({len(bad)} of {n_params} parameters wrong)"
                    )
                problem = _judge_calls(label, s["calls"], bucket_mb, n_params)
                if problem:
                    return problem
    return ""


def _judge_calls(label: str, calls: list, bucket_mb: float, n_params: int) -> str:
    during = [c for c in calls if c[0]]
    if not calls:
        return f"{label}: no dist.all_reduce was called (the check counts calls of dist.all_reduce)"
    if not during:
        return (
            f"{label}: every all-reduce started after backward returned: nothing overlaps it; "
            "start each bucket's all-reduce from a gradient hook as soon as its last gradient "
            "arrives"
        )
    if not all(c[1] for c in during):
        return (
            f"{label}: an all-reduce inside backward is synchronous (no async_op=True): backward "
            "waits for it, so nothing overlaps; wait for the handles in "
            "finish_gradient_synchronization()"
        )
    if bucket_mb >= 100 and len(calls) != 1:
        return (
            f"{label}: {len(calls)} all-reduces per step where one bucket holds every gradient: "
            "flatten each bucket's gradients into one all-reduce"
        )
    if bucket_mb < 100 and not 1 < len(calls) < n_params:
        return (
            f"{label}: {len(calls)} all-reduces per step for {n_params} parameters in buckets of "
            f"{bucket_mb} MiB: expected more than one and fewer than one per parameter"
        )
    return ""


def grade_ddp(spec, kind, call, seed: int, step=None) -> FunctionResult:
    """Grade a bucketed, overlapping data-parallel wrapper: one process group of 2 ranks, both
    bucket sizes, `call(job, inputs)` running it and returning what `run_ddp` returns."""
    result = _result(spec, seed)
    if not _callable(result, kind, spec.name, what="class"):
        return result
    world = 2
    weights, batches, names = ddp_inputs(seed, world)
    job = {"world": world, "buckets": list(DDP_BUCKETS), "params": len(names), "steps": STEPS}
    flat = tuple(w for per_rank in weights for w in per_rank) + tuple(
        t for batch in batches for t in batch
    )
    label = f"N={world}, buckets of {DDP_BUCKETS[0]} MiB and one bucket"
    if step is not None:
        step(spec.name, label, "call")
    try:
        found = call(job, flat)
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    problem = judge_ddp(world, DDP_BUCKETS, weights, batches, names, found)
    result.cases.append(CaseResult(label, not problem, problem))
    if problem:
        result.message = problem
        return result
    result.status, result.points = "pass", spec.points
    return result


# --------------------------------------------------------------------------------------------------
# The spec, and the lab's check cells


def _result(spec, seed) -> FunctionResult:
    return FunctionResult(
        spec.name, spec.backend, spec.description, "fail", 0, spec.points, seed=seed
    )


def _callable(result: FunctionResult, kind, name: str, what: str = "function") -> bool:
    if kind is None:
        result.status, result.message = "missing", f"no {what} named {name} was defined"
        return False
    if kind != "function":  # what function_kind says of anything callable
        result.message = f"{name} is a {kind}, not a {what}"
        return False
    return True


def _not_a_kernel(*args, **kwargs):
    raise TypeError("graded in a process group (grade_group), not through the kernel harness")


def _graded_in_a_group(name, description, grade, run) -> GradedFunction:
    return GradedFunction(
        name=name,
        points=5,
        backend="gloo",
        description=description,
        make_inputs=_not_a_kernel,
        reference_fp64=_not_a_kernel,
        tolerance=_not_a_kernel,
        course_kernel=_not_a_kernel,
        torch_native=_not_a_kernel,
        bytes_moved=_not_a_kernel,
        cases=(),
        grade_group=grade,
        run_group=run,
    )


LAB = LabSpec(
    id="08_communication",
    title="Communication: a ring all-reduce, and data parallelism that overlaps it with backward",
    functions=(
        _graded_in_a_group(
            "ring_all_reduce",
            "ring all-reduce from sends and receives, against the float64 sum (gloo, 2 and 3 "
            "ranks)",
            grade_ring,
            run_ring,
        ),
        _graded_in_a_group(
            "BucketedDDP",
            "bucketed data parallelism overlapping backward, against single-process training "
            "(gloo, 2 ranks)",
            grade_ddp,
            run_ddp,
        ),
    ),
)


def _local(spec, fn):
    """`call` in this process: the notebook's check cells."""
    return lambda job, inputs: spec.run_group(fn, job, inputs)


def _print(name: str, result: FunctionResult) -> bool:
    if result.status == "not implemented":
        print(f"NOT IMPLEMENTED  {name}: not implemented yet")
        return False
    if not result.cases:
        print(f"FAIL  {name}: {result.message}")
        return False
    for case in result.cases:
        line = f"{'PASS' if case.ok else 'FAIL'}  {name} {case.case}"
        print(line + (f": {case.reason}" if not case.ok else ""))
    return result.status == "pass"


def check_ring_all_reduce(fn, seed: int = 0) -> bool:
    """The check cell of part 1: prints a PASS or FAIL line per world size."""
    spec = LAB.function("ring_all_reduce")
    return _print("ring_all_reduce", grade_ring(spec, function_kind(fn), _local(spec, fn), seed))


def check_data_parallel(cls, seed: int = 0) -> bool:
    """The check cell of part 2: one PASS line, or the FAIL with its reason."""
    spec = LAB.function("BucketedDDP")
    return _print("BucketedDDP", grade_ddp(spec, function_kind(cls), _local(spec, cls), seed))
