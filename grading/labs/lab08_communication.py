"""Lab 08: a ring all-reduce from sends and receives, and data parallelism that overlaps the
gradient all-reduce with the backward pass.

Neither is a kernel the harness can call on one tensor: each runs in a process group. The lab's
check cells call `check_ring_all_reduce` and `check_data_parallel`, which start gloo process groups
of CPU processes (`kernels.communication.launch`, forked, so functions defined in a notebook run
as they are), compare with the reference collective and with single-process training, and print one
PASS or FAIL line per check with the reason. `ring_all_reduce_problems` and `data_parallel_problems`
return those reasons (the tests' corpus of wrong submissions reads them).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from grading.spec import LabSpec
from kernels.communication import launch
from kernels.memory_profiling import gpt

LAB = LabSpec(
    id="08_communication",
    title="Communication: a ring all-reduce, and data parallelism that overlaps it with backward",
    functions=(),  # checked by the check cells below, in process groups, not by the kernel harness
)

WORLDS = (2, 4)
# Odd sizes, smaller than the world (empty chunks), not divisible by 2, 3 or 4, and a 2-D tensor.
RING_SHAPES = ((1,), (3,), (7,), (1001,), (37, 29))
TIMEOUT_S = 30.0
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
)
CFG = gpt.GPTConfig(vocab=97, max_seq=16, d_model=32, layers=2, heads=4)
BATCH, SEQ, STEPS = 4, 16, 2
SMALL_BUCKET_MB = 0.02  # about 5 of the tiny GPT's 8k-float blocks per bucket; 100 MiB: one bucket


def _forbid_collectives():
    """Make the collectives raise inside a student's ring: it must be built from sends and
    receives. Returns a function that restores them."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def forbidden(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"uses dist.{name}: build the ring from sends and receives")

        return call

    for name in COLLECTIVES:
        setattr(dist, name, forbidden(name))
    return lambda: [setattr(dist, n, f) for n, f in saved.items()]


def _chunk_report(got, want, world):
    """Which of the world's chunks are wrong, in the ring's terms."""
    bad = [
        i
        for i, (g, w) in enumerate(
            zip(got.view(-1).tensor_split(world), want.view(-1).tensor_split(world))
        )
        if g.numel() and not torch.allclose(g, w, rtol=1e-5, atol=1e-5)
    ]
    return f"chunks {bad} of {world} are wrong" if bad else ""


def _ring_case(rank, world, fn, shapes, seed):
    problems = []
    for k, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(seed + 1000 * k + rank)  # different values per rank
        x = torch.randn(shape, generator=g)
        want64 = x.double()
        dist.all_reduce(want64)
        for average in (False, True):
            want = (want64 / world if average else want64).float()
            got = x.clone()
            restore = _forbid_collectives()
            try:
                returned = fn(got, average=average) if average else fn(got)
            except RuntimeError as e:
                if "uses dist." in str(e):
                    return [str(e)]
                raise
            finally:
                restore()
            label = f"N={world}, shape {tuple(shape)}" + (", average=True" if average else "")
            if returned is not got:
                problems.append(f"{label}: must reduce in place and return its argument")
                break
            if torch.allclose(got, want, rtol=1e-5, atol=1e-5) and not got.isnan().any():
                continue
            if average and torch.allclose(got, want64.float(), rtol=1e-5, atol=1e-5):
                problems.append(
                    f"{label}: returned the sum, not the average: divide by the world size"
                )
            elif torch.allclose(got, x):
                problems.append(f"{label}: the tensor is unchanged: nothing was reduced")
            else:
                err = (got - want).abs().max().item()
                chunks = _chunk_report(got, want, world)
                problems.append(f"{label}: max error {err:.3g}" + (f"; {chunks}" if chunks else ""))
            break
    return problems


def ring_all_reduce_problems(fn, seed: int = 0, worlds=WORLDS) -> dict[int, list[str]]:
    """Per world size, what is wrong with fn(tensor, average=False) (a ring all-reduce) against
    dist.all_reduce on random float32 tensors (an empty list: nothing)."""
    out = {}
    for world in worlds:
        try:
            per_rank = launch.run(
                _ring_case, world, (fn, RING_SHAPES, seed), backend="gloo", timeout_s=TIMEOUT_S
            )
            out[world] = per_rank[0] or next((p for p in per_rank if p), [])
        except TimeoutError:
            out[world] = [
                f"N={world}: did not finish within {TIMEOUT_S:.0f} s: a receive whose "
                "send never comes (do the steps of every rank pair up?)"
            ]
        except RuntimeError as e:
            out[world] = [f"N={world}: raised {_last_line(str(e))}"]
    return out


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def _ddp_case(rank, world, cls, bucket_mb):
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    single = copy.deepcopy(model)  # rank 0's weights: what every replica must start from
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    calls = []  # (during backward?, async_op, elements) of every all-reduce
    original, phase = dist.all_reduce, {"backward": False}

    def recording(tensor, *args, **kwargs):
        calls.append((phase["backward"], bool(kwargs.get("async_op", False)), tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        wrapped = cls(model, bucket_mb=bucket_mb)
        start_ok = all(torch.equal(a, b) for a, b in zip(model.parameters(), single.parameters()))
        flag = torch.tensor([float(start_ok)])
        original(flag, op=dist.ReduceOp.MIN)  # every rank reports a replica that started apart
        start_ok = bool(flag.item())
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        report = {"start_ok": start_ok, "steps": []}
        for step in range(STEPS):
            idx, targets = gpt.make_batch(CFG, BATCH, SEQ, "cpu", seed=step)
            calls.clear()
            phase["backward"] = True
            wrapped(idx[rows], targets[rows]).backward()
            phase["backward"] = False
            wrapped.finish_gradient_synchronization()
            single(idx, targets).backward()
            local = copy.deepcopy(single)  # this rank's own gradient, for the diagnosis
            local.zero_grad()
            local(idx[rows], targets[rows]).backward()
            report["steps"].append(
                {
                    "calls": list(calls),
                    "grads": [
                        (n, p.grad, q.grad, r.grad)
                        for (n, p), q, r in zip(
                            model.named_parameters(), single.parameters(), local.parameters()
                        )
                    ],
                }
            )
            with torch.no_grad():  # the same SGD step on both
                for p, q in zip(model.parameters(), single.parameters()):
                    p.sub_(0.5 * p.grad)
                    q.sub_(0.5 * q.grad)
                    p.grad = q.grad = None
        return _judge_ddp(report, world, bucket_mb)
    finally:
        dist.all_reduce = original


def _close(a, b):
    return a is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def _judge_ddp(report, world, bucket_mb) -> list[str]:
    label = f"N={world}, bucket_mb={bucket_mb}"
    if not report["start_ok"]:
        return [
            f"{label}: the replicas do not start from rank 0's weights: broadcast every "
            "parameter from rank 0 in __init__"
        ]
    n_params = len(report["steps"][0]["grads"])
    for step in report["steps"]:
        bad = [(n, g, want, own) for n, g, want, own in step["grads"] if not _close(g, want)]
        if bad:
            n, g, want, own = bad[0]
            if g is None:
                why = "has no gradient after finish_gradient_synchronization()"
            elif _close(g, world * want):
                why = f"is the sum over the ranks, {world}x the average: divide by the world size"
            elif _close(g, own):
                why = "is this rank's own gradient: it was never all-reduced"
            else:
                err = (g - want).abs().max().item()
                why = f"differs from single-process training by up to {err:.3g}"
            return [
                f"{label}: the gradient of {n} {why} ({len(bad)} of {n_params} parameters wrong)"
            ]
        calls = step["calls"]
        during = [c for c in calls if c[0]]
        if not calls:
            return [
                f"{label}: no dist.all_reduce was called (the check counts calls of "
                "dist.all_reduce)"
            ]
        if not during:
            return [
                f"{label}: every all-reduce started after backward returned: nothing overlaps "
                "it; start each bucket's all-reduce from a gradient hook as soon as its last "
                "gradient arrives"
            ]
        if not all(c[1] for c in during):
            return [
                f"{label}: an all-reduce inside backward is synchronous (no async_op=True): "
                "backward waits for it, so nothing overlaps; wait for the handles in "
                "finish_gradient_synchronization()"
            ]
        if bucket_mb >= 100 and len(calls) != 1:
            return [
                f"{label}: {len(calls)} all-reduces per step where one bucket holds every "
                "gradient: flatten each bucket's gradients into one all-reduce"
            ]
        if bucket_mb < 100 and not 1 < len(calls) < n_params:
            return [
                f"{label}: {len(calls)} all-reduces per step for {n_params} parameters in "
                f"buckets of {bucket_mb} MiB: expected more than one and fewer than one per "
                "parameter"
            ]
    return []


def data_parallel_problems(cls, worlds=(2,), buckets=(SMALL_BUCKET_MB, 100.0)) -> list[str]:
    """What is wrong with cls(model, bucket_mb) (a bucketed, overlapping data-parallel wrapper)
    against single-process training of the same GPT (an empty list: nothing)."""
    problems = []
    for world in worlds:
        for bucket_mb in buckets:
            try:
                per_rank = launch.run(
                    _ddp_case, world, (cls, bucket_mb), backend="gloo", timeout_s=TIMEOUT_S
                )
                problems += per_rank[0] or next((p for p in per_rank if p), [])
            except TimeoutError:
                problems.append(
                    f"N={world}, bucket_mb={bucket_mb}: did not finish within "
                    f"{TIMEOUT_S:.0f} s: do all ranks start the same all-reduces in "
                    "the same order?"
                )
            except RuntimeError as e:
                problems.append(f"N={world}, bucket_mb={bucket_mb}: raised {_last_line(str(e))}")
            if problems:
                return problems
    return problems


def _print(name, problems_by_case) -> bool:
    ok = True
    for case, problems in problems_by_case.items():
        for p in problems or [""]:
            ok &= not p
            print(f"{'PASS' if not p else 'FAIL'}  {name} {case}" + (f": {p}" if p else ""))
    return ok


def check_ring_all_reduce(fn) -> bool:
    """The check cell of part 1: prints a PASS or FAIL line per world size."""
    try:
        problems = ring_all_reduce_problems(fn)
    except NotImplementedError:
        print("NOT IMPLEMENTED  ring_all_reduce: not implemented yet")
        return False
    if any("NotImplementedError" in p for ps in problems.values() for p in ps):
        print("NOT IMPLEMENTED  ring_all_reduce: not implemented yet")
        return False
    return _print("ring_all_reduce", {f"N={w}": p for w, p in problems.items()})


def check_data_parallel(cls) -> bool:
    """The check cell of part 2: one PASS line, or the first FAIL with its reason."""
    problems = data_parallel_problems(cls)
    if any("NotImplementedError" in p for p in problems):
        print("NOT IMPLEMENTED  BucketedDDP: not implemented yet")
        return False
    return _print("BucketedDDP", {"N=2, buckets of 0.02 MiB and one bucket": problems})
