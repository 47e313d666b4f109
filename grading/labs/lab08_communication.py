"""Lab 08: a ring all-reduce from sends and receives, and data parallelism that overlaps the
gradient all-reduce with the backward pass.

Neither is a kernel the harness can call on one tensor: each runs in a process group of CPU
processes, whose every message passes through the grader (grading/ranks.py). Grading one is two
halves, apart:

* `_ring_rank` / `_ddp_rank` run in each rank: the student's code on this rank's inputs, and what
  it produced (output tensors, gradients). A rank is given its own inputs only: under `python -m
  grading` each is a fresh process in a sandbox of its own that imports the graded module itself,
  so no frame, object or file it can reach holds another rank's inputs.
* `grade_ring` / `grade_ddp` make the inputs from the seed, have the ranks run (`call`), and judge
  against references computed where the verdict is made: the float64 sum of the ranks' inputs
  (what `dist.all_reduce` computes), and single-process training of the same GPT on the whole
  batch. Who sent to whom, which collectives were called, and whether gradients were all-reduced
  while backward still ran come from the relay's log, kept in the grader's process; a rank's own
  account is never asked for.

The overlap is made observable by a gate: backward's gradient, on its way into the embeddings (the
last parameters it reaches), is scaled by a power of two the relay gives a rank only when that
rank asks, from inside backward. The embeddings' gradients cannot be right before the gate is
passed, so an all-reduce the relay saw before the gate, holding this rank's own gradients, ran
while backward was still running.

The lab's check cells (`check_ring_all_reduce`, `check_data_parallel`) run both halves in the
notebook's process with seed 0 (the ranks forked from it, so a function defined in a cell runs as
it is), and print one PASS or FAIL line per process group with the reason.
"""

from __future__ import annotations

import copy
import io
import random
import traceback

import torch

from grading import ranks
from grading.harness import function_kind
from grading.results import CaseResult, FunctionResult
from grading.spec import GradedFunction, LabSpec
from kernels.communication import launch
from kernels.memory_profiling import gpt

LAB_ID = "08_communication"
WORLDS = (2, 3)  # an even and an odd number of ranks; sizes below are not multiples of either
TIMEOUT_S = 60.0  # per process group, from the start of its fresh processes
RING_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# Empty, smaller than the world (empty chunks), odd, and a 2-D tensor; two more drawn per seed.
RING_SHAPES = ((0,), (1,), (2,), (7,), (1001,), (37, 29))
CFG = gpt.GPTConfig(vocab=97, max_seq=16, d_model=32, layers=2, heads=4)
BATCH, SEQ, STEPS = 4, 16, 2
SMALL_BUCKET_MB = 0.02  # about 5 of the tiny GPT's 8k-float blocks per bucket; 100 MiB: one bucket
DDP_BUCKETS = (SMALL_BUCKET_MB, 100.0)  # the small buckets first: their gates are not known yet
GATE_SCALES = (0.25, 0.5, 2.0, 4.0)  # powers of two: scaling rounds nothing


def _raised(label: str, exc: BaseException) -> ranks.RankError:
    """The exception of a student's call, with the line of the student's code it came from."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and "site-packages" not in f.filename
        and not f.filename.endswith("grading/ranks.py")
    ]
    where = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return ranks.RankError(f"{label}: raised {type(exc).__name__}: {exc}{where}")


# What a forked rank raises when this process ran a backward pass first with a GPU present:
# autograd's device threads do not survive a fork.
AUTOGRAD_FORK = "autograd's threading in combination with fork-based multiprocessing"


def _group_error(world: int, found) -> str | None:
    """Why the process group gave no results (None if it did), with its world size."""
    if "error" not in found:
        return None
    why = str(found["error"])
    if AUTOGRAD_FORK in why:
        return (f"N={world}: the ranks could not run backward: this process ran a backward pass "
                "before forking them, and with a GPU present autograd's threads do not survive a "
                "fork. Restart the kernel and run this check before any backward (or grade with "
                "python -m grading, whose ranks are fresh processes)")
    return why if why.startswith("N=") else f"N={world}: {why}"


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


def _ring_rank(fn, rank: int, world: int, job: dict, inputs: list) -> dict:
    """In each rank: fn on this rank's input of every case, in order; what it left and returned.
    Each case's messages are labelled with it in the relay's log."""
    out = []
    for case, x in zip(job["cases"], inputs):
        label = _label(world, case["shape"], case["dtype"], case["average"])
        ranks.mark(label)
        tensor = x.clone()
        try:
            returned = fn(tensor, average=True) if case["average"] else fn(tensor)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the student's error, with its case
            raise _raised(label, exc) from None
        out.append({"output": tensor.detach().clone(), "in_place": returned is tensor,
                    "returned": type(returned).__name__})
    return {"cases": out}


def _chunk_report(bad: torch.Tensor, world: int) -> str:
    """Which of the ring's chunks hold wrong elements."""
    wrong = [i for i, c in enumerate(bad.reshape(-1).tensor_split(world)) if c.any()]
    return f"chunks {wrong} of {world} are wrong" if wrong else ""


def _is_tensor(x) -> bool:
    return type(x) is torch.Tensor


def _well_formed_ring(found, world: int, n_cases: int) -> bool:
    if not isinstance(found, dict) or not isinstance(found.get("log"), list):
        return False
    if "error" in found:
        return isinstance(found["error"], str)
    ranks_ = found.get("ranks")
    return (
        isinstance(ranks_, list)
        and len(ranks_) == world
        and all(isinstance(r, dict) and isinstance(r.get("cases"), list)
                and len(r["cases"]) == n_cases for r in ranks_)
        and all(
            isinstance(c, dict)
            and _is_tensor(c.get("output"))
            and isinstance(c.get("in_place"), bool)
            and isinstance(c.get("returned"), str)
            for r in ranks_
            for c in r["cases"]
        )
    )


def _not_a_ring(rank: int, world: int, sent_to, received_from) -> str:
    """Why one rank's sends and receives are not a ring's ("" if they are): a ring sends only to
    one neighbour and receives only from the other (either way round)."""
    right, left = (rank + 1) % world, (rank - 1) % world
    sent, received = set(sent_to), set(received_from)
    if (sent <= {right} and received <= {left}) or (sent <= {left} and received <= {right}):
        return ""
    return (f"rank {rank} sent to ranks {sorted(sent)} and received from {sorted(received)} "
            f"(-1: any), as the grader's relay saw: a ring sends only to its next rank and "
            f"receives only from the one before it (a star or an all-to-all is not a ring)")


def judge_topology(world: int, log: list[dict]) -> str:
    """What the relay saw that a ring built from sends and receives does not do ("" if
    nothing): a library collective, or a rank whose peers, over the whole run, are not its two
    neighbours. Named by the case (the rank's label) where it first shows."""
    peers = [(set(), set()) for _ in range(world)]
    for event in log:
        rank, op, label = event["rank"], event["op"], event["label"] or f"N={world}"
        if op in ranks.LIBRARY:
            return (f"{label}: uses the library collective {ranks.LIBRARY[op]} (the grader's "
                    f"relay saw rank {rank} call it): build the ring from sends and receives")
        if op in ("send", "recv"):
            peers[rank][op == "recv"].add(event["peer"])
            if _not_a_ring(rank, world, *peers[rank]):  # named by the case's first such rank
                for r in range(world):
                    in_case = [e for e in log if e["rank"] == r and e["label"] == event["label"]]
                    sent = {e["peer"] for e in in_case if e["op"] == "send"}
                    received = {e["peer"] for e in in_case if e["op"] == "recv"}
                    if _not_a_ring(r, world, sent, received):
                        return f"{label}: {_not_a_ring(r, world, sent, received)}"
                return f"{label}: {_not_a_ring(rank, world, *peers[rank])}"
    return ""


def judge_ring(world: int, cases: list[dict], inputs, found) -> str:
    """What is wrong with one process group's results ("" if nothing): first the relay's log
    (the topology), then the outputs against the float64 sum of the ranks' inputs: each addition
    may round once in the tensor's dtype."""
    if not _well_formed_ring(found, world, len(cases)):
        return f"N={world}: the ranks' results could not be read (not what the call returns)"
    problem = judge_topology(world, found["log"]) or _group_error(world, found)
    if problem:
        return problem
    outcomes = [r["cases"] for r in found["ranks"]]
    for k, case in enumerate(cases):
        dtype, average = getattr(torch, case["dtype"]), case["average"]
        label = _label(world, case["shape"], case["dtype"], average)
        xs = [inputs[r][k].double() for r in range(world)]
        total = torch.stack(xs).sum(0) if xs[0].numel() else xs[0].clone()
        want = total / world if average else total
        # world - 1 additions and a division, each rounding by at most eps / 2 of what it makes
        magnitude = torch.stack(xs).abs().sum(0) / (world if average else 1)
        allowed = (world + 1) * torch.finfo(dtype).eps * magnitude + torch.finfo(dtype).tiny
        for rank, got in enumerate(outcomes):
            c = got[k]
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
    return ""


def _ask(call, groups: list) -> list[dict]:
    """`call`'s answer per group; NotImplementedError where a rank said so."""
    found = call(groups)
    if not isinstance(found, list) or len(found) != len(groups):
        return [{} for _ in groups]  # not results: each group's judge says so
    if any(isinstance(f, dict) and f.get("not_implemented") for f in found):
        raise NotImplementedError
    return found


def grade_ring(spec, kind, call, seed: int, step=None) -> FunctionResult:
    """Grade a ring all-reduce: one process group per world size, `call(groups)` running them
    (`grading.ranks.run_forked` or `run_spawned`), each group `(job, per_rank, gates)`."""
    result = _result(spec, seed)
    if not _callable(result, kind, spec.name):
        return result
    worlds = []
    for world in WORLDS:
        cases = ring_cases(seed, world)
        worlds.append((world, cases, ring_inputs(seed, world, cases)))
    if step is not None:
        step(spec.name, ", ".join(f"N={w}: {len(c)} tensors" for w, c, _ in worlds), "call")
    try:
        found = _ask(call, [({"lab": LAB_ID, "world": w, "cases": c}, inputs, None)
                            for w, c, inputs in worlds])
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    for (world, cases, inputs), group in zip(worlds, found):
        problem = judge_ring(world, cases, inputs, group)
        result.cases.append(CaseResult(f"N={world}: {len(cases)} tensors", not problem, problem))
        if problem:
            result.message = problem
            return result
    result.status, result.points = "pass", spec.points
    return result


# --------------------------------------------------------------------------------------------------
# Part 2: BucketedDDP(module, bucket_mb)


def ddp_inputs(seed: int, world: int) -> tuple[list, list, list, list]:
    """(initial weights per rank, batches, parameter names, the gate's scale per step): rank 0's
    weights are the GPT's initialization from the seed; the other ranks' differ (the wrapper must
    broadcast rank 0's)."""
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
    return weights, batches, names, [rng.choice(GATE_SCALES) for _ in range(STEPS)]


def _rows(rank: int, world: int) -> slice:
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


class _Gate(torch.autograd.Function):
    """Identity forward; backward scales the gradient by `scale_of()`, asked for only then."""

    @staticmethod
    def forward(ctx, x, scale_of):
        ctx.scale_of = scale_of
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale_of(), None


def gated(model: gpt.GPT, scale_of) -> gpt.GPT:
    """The GPT with the gate between its embeddings and its first block: the embeddings'
    gradients, the last backward computes, are scaled by what `scale_of()` returns then."""
    model.blocks[0].register_forward_pre_hook(lambda _, args: (_Gate.apply(args[0], scale_of),))
    return model


def _ddp_rank(cls, rank: int, world: int, job: dict, inputs: dict) -> list:
    """In each rank: for each bucket size, the GPT with this rank's weights wrapped in cls, STEPS
    SGD steps on this rank's rows (the only rows it is given); the weights after __init__, and per
    step the gradients after finish_gradient_synchronization(). The gate's scale comes from the
    relay."""
    out = []
    for bucket_mb in job["buckets"]:
        label = f"N={world}, bucket_mb={bucket_mb}"
        ranks.mark(f"{label}: __init__")
        model = gated(gpt.GPT(CFG), ranks.gate)
        with torch.no_grad():
            for p, w in zip(model.parameters(), inputs["weights"]):
                p.copy_(w)
        try:
            wrapped = cls(model, bucket_mb=bucket_mb)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _raised(f"{label}: __init__", exc) from None
        report = {"start": [p.detach().clone() for p in model.parameters()], "steps": []}
        for step, (idx, targets) in enumerate(inputs["batches"]):
            ranks.mark(f"{label}, step {step}")
            try:
                wrapped(idx, targets).backward()
                wrapped.finish_gradient_synchronization()
            except NotImplementedError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise _raised(label, exc) from None
            report["steps"].append(
                [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
            )
            with torch.no_grad():  # SGD on this replica, with its own (averaged) gradients
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.5 * p.grad)
                    p.grad = None
        out.append(report)
    return out


def _reference_rank(rank: int, world: int, weights0, batches, scales, ranks_: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(ddp_reference(weights0, batches, ranks_, scales), buffer)
    return buffer.getvalue()


def ddp_reference_forked(weights0: list, batches: list, world: int, scales: list):
    """`ddp_reference` in a process of its own: a backward pass in this process would start
    autograd's device threads (with a GPU present), and ranks forked after it could not run
    backward -- a check cell run twice would fail the second time. `launch.run` forks it without
    a GPU (milliseconds) and spawns it with one, since this process may have run a backward
    already (an earlier lab's judge in `python -m grading`, a notebook cell), and then no fork
    could."""
    [packed] = launch.run(_reference_rank, 1, (weights0, batches, scales, world),
                          backend="gloo", timeout_s=TIMEOUT_S * 3, threads=1)
    return torch.load(io.BytesIO(packed), weights_only=True)


def ddp_reference(weights0: list, batches: list, world: int, scales: list):
    """Single-process training on the whole batch from rank 0's weights, the gate scaling step
    s's embedding gradients by scales[s]: per step, the gradients (what every replica must hold
    after finish_gradient_synchronization) and each rank's own gradient on its rows (what an
    all-reduce that never happened leaves, and what a rank's all-reduces must hold)."""
    step = [0]
    model = gated(gpt.GPT(CFG), lambda: scales[step[0]])
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights0):
            p.copy_(w)
    out = []
    for step[0], (idx, targets) in enumerate(batches):
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
    if not isinstance(found, dict) or not isinstance(found.get("log"), list):
        return False
    if "error" in found:
        return isinstance(found["error"], str)
    ranks_ = found.get("ranks")

    def report_ok(r):
        return (
            isinstance(r, dict)
            and isinstance(r.get("start"), list)
            and len(r["start"]) == n_params
            and all(_is_tensor(t) for t in r["start"])
            and isinstance(r.get("steps"), list)
            and len(r["steps"]) == STEPS
            and all(isinstance(s, list) and len(s) == n_params
                    and all(g is None or _is_tensor(g) for g in s) for s in r["steps"])
        )

    return (
        isinstance(ranks_, list)
        and len(ranks_) == world
        and all(isinstance(r, list) and len(r) == n_buckets for r in ranks_)
        and all(report_ok(rep) for r in ranks_ for rep in r)
    )


def judge_ddp(world: int, buckets, inputs: tuple, names, found) -> str:
    """What is wrong with one process group's data-parallel training ("" if nothing). `inputs`:
    what `ddp_inputs` made."""
    weights, batches, _, scales = inputs
    if not _well_formed_ddp(found, world, len(buckets), len(names)):
        return f"N={world}: the ranks' results could not be read (not what the call returns)"
    problem = _group_error(world, found)
    if problem:
        return problem
    reference = ddp_reference_forked(weights[0], batches, world, scales)
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
            for step, (grads, (want, local)) in enumerate(zip(per_bucket[b]["steps"], reference)):
                bad = [i for i in range(n_params) if not _close(grads[i], want[i])]
                if bad:
                    i = bad[0]
                    g = grads[i]
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
                seen = [e for e in found["log"]
                        if e["rank"] == rank and e["label"] == f"{label}, step {step}"]
                problem = judge_overlap(label, seen, bucket_mb, local[rank], world)
                if problem:
                    return problem
    return ""


def whole_gradients(tensor: torch.Tensor, local: list, world: int) -> int:
    """How many of a rank's gradients `tensor` holds, whole and concatenated in any order (each
    as it is, or divided by the world size already); 0 if any of it is something else."""
    flat, used, at = tensor.reshape(-1).double(), set(), 0
    while at < flat.numel():
        for i, g in enumerate(local):
            piece = flat[at: at + g.numel()]
            if i not in used and piece.numel() == g.numel() and any(
                    torch.allclose(piece, g.reshape(-1).double() * c, rtol=1e-4, atol=1e-6)
                    for c in (1.0, 1.0 / world)):
                used.add(i)
                at += g.numel()
                break
        else:
            return 0
    return len(used)


def judge_overlap(label: str, seen: list[dict], bucket_mb: float, local: list,
                  world: int) -> str:
    """One rank's step, from the relay's log `seen` (its events in order): with small buckets, an
    all-reduce holding its own gradients before its gate (while backward still ran) and no wait
    for one before the gate; with one bucket, one all-reduce."""
    calls = [e for e in seen if e["op"] == "allreduce"]
    if not calls:
        return f"{label}: no dist.all_reduce was called (the check counts calls of dist.all_reduce)"
    gate = next((i for i, e in enumerate(seen) if e["op"] == "gate"), len(seen))
    if bucket_mb < 100:
        early = [e for e in seen[:gate] if e["op"] == "allreduce"]
        if not early:
            return (
                f"{label}: every all-reduce started after backward returned: nothing overlaps "
                "it; start each bucket's all-reduce from a gradient hook as soon as its last "
                "gradient arrives"
            )
        if not any(whole_gradients(e["tensor"], local, world) for e in early):
            elements = sum(e["tensor"].numel() for e in early)
            return (
                f"{label}: the {len(early)} all-reduces started during backward ({elements} "
                "elements) hold none of this rank's gradients, as the grader's relay saw them: "
                "nothing of the gradients' all-reduce overlaps backward; start each bucket's "
                "all-reduce of its gradients as soon as the bucket is full"
            )
        early_ids = {e["id"] for e in early}
        if any(e["op"] == "wait" and e["id"] in early_ids for e in seen[:gate]):
            return (
                f"{label}: an all-reduce inside backward is synchronous (no async_op=True): "
                "backward waits for it, so nothing overlaps; wait for the handles in "
                "finish_gradient_synchronization()"
            )
    n_params = len(local)
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
    bucket sizes, `call([(job, per_rank, gates)])` running it. Each rank is given its weights and
    its rows of each batch, nothing else."""
    result = _result(spec, seed)
    if not _callable(result, kind, spec.name, what="class"):
        return result
    world = 2
    inputs = ddp_inputs(seed, world)
    weights, batches, names, scales = inputs
    job = {"lab": LAB_ID, "world": world, "buckets": list(DDP_BUCKETS)}
    per_rank = [{"weights": weights[r],
                 "batches": [(idx[_rows(r, world)], targets[_rows(r, world)])
                             for idx, targets in batches]} for r in range(world)]
    gates = [[s for _ in DDP_BUCKETS for s in scales] for _ in range(world)]
    label = f"N={world}, buckets of {DDP_BUCKETS[0]} MiB and one bucket"
    if step is not None:
        step(spec.name, label, "call")
    try:
        [found] = _ask(call, [(job, per_rank, gates)])
    except NotImplementedError:
        result.status, result.message, result.cases = "not implemented", "not implemented yet", []
        return result
    problem = judge_ddp(world, DDP_BUCKETS, inputs, names, found)
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
            "ring all-reduce from sends and receives, against the float64 sum (2 and 3 CPU "
            "ranks)",
            grade_ring,
            _ring_rank,
        ),
        _graded_in_a_group(
            "BucketedDDP",
            "bucketed data parallelism overlapping backward, against single-process training "
            "(2 CPU ranks)",
            grade_ddp,
            _ddp_rank,
        ),
    ),
)


def local_call(spec, fn):
    """`call` with the ranks forked from this process: the notebook's check cells."""
    return lambda groups: ranks.run_forked(spec.run_group, fn, groups, timeout_s=TIMEOUT_S)


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
    result = grade_ring(spec, function_kind(fn), local_call(spec, fn), seed)
    return _print("ring_all_reduce", result)


def check_data_parallel(cls, seed: int = 0) -> bool:
    """The check cell of part 2: one PASS line, or the FAIL with its reason."""
    spec = LAB.function("BucketedDDP")
    return _print("BucketedDDP", grade_ddp(spec, function_kind(cls), local_call(spec, cls), seed))
