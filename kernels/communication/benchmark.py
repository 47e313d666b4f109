"""Measure what `cost_model` predicts: point-to-point alpha and beta, the ring all-reduce against
`dist.all_reduce`, data-parallel steps with and without overlap, and sharded optimizer state.

    python -m kernels.communication.benchmark            # gloo, CPU processes (about a minute)
    python -m kernels.communication.benchmark --quick    # small sizes only (what the notebook runs)
    python -m kernels.communication.benchmark --ring     # the ring's target only (a few minutes)

On a machine with several GPUs the same command runs NCCL, one GPU per rank, and writes
data/results/<gpu>/08_communication_nccl.json; with gloo it writes
data/results/cpu-gloo/08_communication.json. `--ring` measures the ring's target alone (>= 80% of
`dist.all_reduce`'s bus bandwidth at >= 64 MiB): the course's two rings and `dist.all_reduce`,
interleaved, in several fresh process groups, into
data/results/cpu-<cores>core/08_communication_ring.json (NCCL:
data/results/<gpu>/08_communication_ring_nccl.json). Each file carries the environment fingerprint
(CPU model and cores, GPU, torch, backend) and the load average before and after the run: CPU
timings taken on a busy machine are noisy, and the file says how busy it was.

Method. Every timed operation is preceded by a barrier; each rank times itself with the host clock
(gloo's collectives return when this rank's part is done; under NCCL the device is synchronized);
a repetition's time is the slowest rank's; the ring and `dist.all_reduce` alternate repetition by
repetition so drift hits both; the median is reported, with the 10th-90th percentile spread.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist

from kernels import bench, runtime
from kernels.communication import cost_model, ddp, launch, ring, ring_pipelined, sharded_optimizer
from kernels.memory_profiling import gpt

MiB = 2**20
# A GPT small enough for CPU processes, its layers alike (as the overlap model assumes): 0.95 M
# parameters.
DDP_CONFIG = gpt.GPTConfig(vocab=1024, max_seq=64, d_model=256, layers=4, heads=4)
DDP_BATCH_PER_RANK, DDP_SEQ = 1, 32
DDP_BUCKET_MB = 1.0
DDP_WAIT_S = 0.01  # per block, in the "waiting backward" runs: 40 ms, about the CPU's backward


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(backend: str) -> dict:
    fp = runtime.fingerprint()
    fp.update(
        backend=backend,
        cpu_model=cpu_model(),
        cpu_cores=os.cpu_count(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    )
    return fp


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> float:
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _summary(seconds: list[float]) -> dict:
    q = statistics.quantiles(seconds, n=10, method="inclusive") if len(seconds) > 1 else None
    med = statistics.median(seconds)
    return {"median_s": med, "p10_s": q[0] if q else med, "p90_s": q[-1] if q else med}


# --------------------------------------------------------------------------------------------------
# Point to point: alpha and beta


def _ping_pong(rank, world, sizes, reps):
    device = launch.device_for(rank, dist.get_backend())
    out = {}
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=device)
        times = []
        for _ in range(reps + 1):  # the first is a warm-up

            def exchange():
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                elif rank == 1:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)

            times.append(_timed(exchange, device) / 2)  # one way
        out[size] = times[1:]
    return out


def measure_alpha_beta(sizes=(4, 64 * 1024, MiB, 4 * MiB), reps=9, backend=None) -> dict:
    """One-way point-to-point times between two ranks, and the alpha-beta fit to the fastest
    repetition of each size: what the link can do. On a busy machine the other repetitions add
    the time the process waited to be scheduled, which is not a property of the link."""
    per_rank = launch.run(_ping_pong, 2, (list(sizes), reps), backend=backend)
    fastest = {s: min(per_rank[0][s]) for s in sizes}
    alpha, beta = cost_model.fit_alpha_beta(list(fastest), list(fastest.values()))
    return {
        "one_way_min_s": {str(s): t for s, t in fastest.items()},
        "one_way_median_s": {str(s): statistics.median(per_rank[0][s]) for s in sizes},
        "alpha_s": alpha,
        "beta_bps": beta,
    }


# --------------------------------------------------------------------------------------------------
# All-reduce: the ring against dist.all_reduce


def _all_reduce_sweep(rank, world, sizes, reps):
    device = launch.device_for(rank, dist.get_backend())
    out = {}
    for size in sizes:
        x = torch.randn(size // 4, device=device)
        impls = {"ring": lambda: ring.ring_all_reduce(x), "torch": lambda: dist.all_reduce(x)}
        times = {name: [] for name in impls}
        for rep in range(reps + 1):
            for name, fn in impls.items():
                t = _timed(fn, device)
                if rep:  # the first round warms up
                    times[name].append(t)
        out[size] = times
    return out


def all_reduce_sweep(world: int, sizes, reps: int, backend=None) -> list[dict]:
    """Rows of (size, impl, median time, bus bandwidth), the slowest rank's time per repetition."""
    per_rank = launch.run(_all_reduce_sweep, world, (list(sizes), reps), backend=backend)
    rows = []
    for size in sizes:
        for impl in ("ring", "torch"):
            slowest = [max(r[size][impl][i] for r in per_rank) for i in range(reps)]
            s = _summary(slowest)
            rows.append(
                {
                    "world": world,
                    "bytes": size,
                    "impl": impl,
                    **s,
                    "busbw_gbps": cost_model.bus_bandwidth(size, world, s["median_s"]) / 1e9,
                }
            )
    return rows


# --------------------------------------------------------------------------------------------------
# The ring's target: >= 80% of dist.all_reduce's bus bandwidth for messages >= 64 MiB

RING_TARGET = 0.80
RING_IMPLS = {
    "ring": ring.ring_all_reduce,  # ring.py: a fresh receive buffer per call, one step at a time
    # one segment per chunk: ring.py's schedule with the receive buffer kept between calls
    "one segment": lambda x: ring_pipelined.pipelined_ring_all_reduce(x, segment_bytes=2**62),
    "pipelined": ring_pipelined.pipelined_ring_all_reduce,  # segments of SEGMENT_BYTES
    "torch": dist.all_reduce,
}


def _minor_faults() -> int:
    """Page faults this process (every thread: gloo's too) served without I/O, so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _ring_rounds(rank, world, sizes, reps):
    device = launch.device_for(rank, dist.get_backend())
    out = {}
    for size in sizes:
        source = torch.randn(size // 4, device=device)
        x = torch.empty_like(source)
        names = list(RING_IMPLS)
        times = {name: [] for name in names}
        faults = {name: [] for name in names}
        for rep in range(reps + 1):  # the first round warms up
            # interleaved, and each round starts with another implementation
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                x.copy_(source)  # the same values every call, outside the timed region
                before = _minor_faults()
                t = _timed(lambda: RING_IMPLS[name](x), device)
                if rep:
                    times[name].append(t)
                    faults[name].append(_minor_faults() - before)
        out[size] = {"times": times, "minor_faults": faults}
    return out


def ring_target(worlds=(2, 4), sizes=(64 * MiB, 128 * MiB), reps=15, repeats=3, backend=None):
    """The course's rings against `dist.all_reduce`: `repeats` fresh process groups per world
    size, `reps` interleaved rounds each; per repeat the median time of each (the slowest rank's,
    per round), its bus bandwidth and its share of `dist.all_reduce`'s (the ratio of medians)."""
    rows = []
    for world in worlds:
        for repeat in range(repeats):
            per_rank = launch.run(
                _ring_rounds, world, (list(sizes), reps), backend=backend, timeout_s=600
            )
            for size in sizes:
                med = {
                    name: statistics.median(
                        max(r[size]["times"][name][i] for r in per_rank) for i in range(reps)
                    )
                    for name in RING_IMPLS
                }
                for name in RING_IMPLS:
                    rows.append(
                        {
                            "world": world,
                            "bytes": size,
                            "repeat": repeat,
                            "impl": name,
                            "median_s": med[name],
                            "busbw_gbps": cost_model.bus_bandwidth(size, world, med[name]) / 1e9,
                            "of_torch_busbw": med["torch"] / med[name],
                            "minor_faults_per_call": statistics.median(
                                per_rank[0][size]["minor_faults"][name]
                            ),
                        }
                    )
    return rows


def ring_target_summary(rows) -> list[dict]:
    """Per world, size and implementation: the median, lowest and highest share of
    `dist.all_reduce`'s bus bandwidth over the repeats."""
    keys = sorted({(r["world"], r["bytes"], r["impl"]) for r in rows})
    out = []
    for world, size, impl in keys:
        shares = [
            r["of_torch_busbw"]
            for r in rows
            if (r["world"], r["bytes"], r["impl"]) == (world, size, impl)
        ]
        out.append(
            {
                "world": world,
                "bytes": size,
                "impl": impl,
                "share_median": statistics.median(shares),
                "share_min": min(shares),
                "share_max": max(shares),
                "repeats": len(shares),
            }
        )
    return out


def run_ring_target(backend: str, repeats: int = 3) -> dict:
    """`--ring`: measure, print and save the ring's target."""
    results = {"fingerprint": environment(backend), "target": RING_TARGET}
    started = time.perf_counter()
    worlds = (2, 4) if backend == "gloo" or torch.cuda.device_count() >= 4 else (2,)
    results["rows"] = rows = ring_target(worlds=worlds, repeats=repeats, backend=backend)
    results["summary"] = summary = ring_target_summary(rows)
    results["segment_bytes"] = ring_pipelined.SEGMENT_BYTES
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for s in summary:
        faults = statistics.median(
            r["minor_faults_per_call"]
            for r in rows
            if (r["world"], r["bytes"], r["impl"]) == (s["world"], s["bytes"], s["impl"])
        )
        print(
            f"N={s['world']} {s['bytes'] / MiB:5.0f} MiB {s['impl']:12s} "
            f"{s['share_median']:5.0%} of dist.all_reduce's busbw "
            f"({s['share_min']:.0%}-{s['share_max']:.0%} over {s['repeats']} repeats), "
            f"{faults:7.0f} page faults per call"
        )
    if backend == "nccl":
        path = bench.save_results("08_communication_ring_nccl", results)
    else:
        cores = os.cpu_count()
        path = bench.save_results("08_communication_ring", results, gpu_slug=f"cpu-{cores}core")
    print(f"wrote {path}")
    return results


# --------------------------------------------------------------------------------------------------
# Data-parallel steps on the GPT: compute alone, communication alone, and both


class WaitInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps `seconds` before passing the gradient on. A backward
    that waits instead of computing leaves the CPU free, as a GPU's backward leaves the host and
    the network free: with it, overlap on a CPU shows what it does on a GPU."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def _ddp_step_times(rank, world, cfg, batch, seq, bucket_mb, steps, wait_s):
    device = launch.device_for(rank, dist.get_backend())
    torch.manual_seed(0)
    base = gpt.GPT(cfg).to(device)
    if wait_s:
        for block in base.blocks:
            block.register_forward_pre_hook(lambda m, a: (WaitInBackward.apply(a[0], wait_s),))
    idx, targets = gpt.make_batch(cfg, batch, seq, device, seed=rank)

    def fwd_bwd(model):
        model(idx, targets).backward()

    variants = {
        "compute only": copy.deepcopy(base),
        "overlapped": ddp.DataParallel(copy.deepcopy(base), bucket_mb, overlap=True),
        "per parameter": ddp.DataParallel(copy.deepcopy(base), 0.0, overlap=True),
        "after backward": ddp.DataParallel(copy.deepcopy(base), bucket_mb, overlap=False),
    }
    buckets = variants["overlapped"].buckets
    times = {name: [] for name in [*variants, "communication only"]}
    exposed = {name: [] for name in variants if name != "compute only"}

    def comm_only():
        for b in buckets:
            dist.all_reduce(b.flat)

    for step in range(steps + 1):
        for name, model in variants.items():
            model.zero_grad(set_to_none=True)
            if name == "compute only":
                t = _timed(lambda: fwd_bwd(model), device)
            else:
                t = _timed(
                    lambda: (fwd_bwd(model), model.finish_gradient_synchronization()), device
                )
            if step:
                times[name].append(t)
                if name in exposed:
                    exposed[name].append(model.exposed_s)
        t = _timed(comm_only, device)
        if step:
            times["communication only"].append(t)
    return {
        "times": times,
        "exposed": exposed,
        "bucket_bytes": [b.flat.numel() * b.flat.element_size() for b in buckets],
        "param_bytes": [
            b.flat.numel() * b.flat.element_size() for b in variants["per parameter"].buckets
        ],
        "params": sum(p.numel() for p in base.parameters()),
    }


def ddp_steps(world=2, steps=8, bucket_mb=DDP_BUCKET_MB, wait_s=0.0, backend=None) -> dict:
    """Time per step of the GPT on `world` ranks: forward + backward alone, the buckets'
    all-reduces alone, and DataParallel overlapped (buckets of `bucket_mb`), per parameter, and
    after backward. `wait_s`: each block's backward also sleeps this long (`WaitInBackward`)."""
    per_rank = launch.run(
        _ddp_step_times,
        world,
        (DDP_CONFIG, DDP_BATCH_PER_RANK, DDP_SEQ, bucket_mb, steps, wait_s),
        backend=backend,
    )
    names = list(per_rank[0]["times"])
    med = {
        n: statistics.median(max(r["times"][n][i] for r in per_rank) for i in range(steps))
        for n in names
    }
    # exposed: how long finish_gradient_synchronization() waited, on the rank that waited least.
    # A rank that ends backward early also waits for its slower peer (the machine's other jobs
    # decide which that is); the last rank to arrive waits only for what is left to send.
    exp = {
        n: statistics.median(min(r["exposed"][n][i] for r in per_rank) for i in range(steps))
        for n in per_rank[0]["exposed"]
    }
    comm = med["communication only"]
    return {
        "world": world,
        "config": DDP_CONFIG.__dict__,
        "batch_per_rank": DDP_BATCH_PER_RANK,
        "seq": DDP_SEQ,
        "bucket_mb": bucket_mb,
        "backward_wait_s_per_block": wait_s,
        "params": per_rank[0]["params"],
        "bucket_bytes": per_rank[0]["bucket_bytes"],
        "param_bytes": per_rank[0]["param_bytes"],
        "step_median_s": med,
        "exposed_median_s": exp,
        # hidden: the share of the communication-only time that was not left to wait for
        "hidden_fraction": {n: 1.0 - exp[n] / comm for n in exp},
        # the same from step times: (compute + communication - step) / communication; negative
        # where the step grew by more than the communication takes alone
        "hidden_fraction_from_steps": {
            n: 1.0 - (med[n] - med["compute only"]) / comm
            for n in ("overlapped", "per parameter", "after backward")
        },
        "steps": steps,
    }


# --------------------------------------------------------------------------------------------------
# Optimizer state per rank, sharded and not


def _optimizer_state(rank, world, cfg, steps):
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    reference = copy.deepcopy(model)
    sharded = sharded_optimizer.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    full = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    peak_sharded = peak_full = 0
    for step in range(steps):
        idx, targets = gpt.make_batch(cfg, 2, cfg.max_seq, "cpu", seed=step)
        for m, opt in ((model, sharded), (reference, full)):
            m(idx, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak_sharded = max(peak_sharded, sharded.state_bytes())
        peak_full = max(peak_full, sharded_optimizer.state_bytes(full))
    max_diff = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
    )
    return {"sharded_bytes": peak_sharded, "full_bytes": peak_full, "max_param_diff": max_diff}


def optimizer_state(world: int, steps: int = 3) -> dict:
    per_rank = launch.run(_optimizer_state, world, (DDP_CONFIG, steps), backend="gloo")
    full = per_rank[0]["full_bytes"]
    return {
        "world": world,
        "full_bytes": full,
        "sharded_bytes_per_rank": [r["sharded_bytes"] for r in per_rank],
        "largest_shard_fraction": max(r["sharded_bytes"] for r in per_rank) / full,
        "max_param_diff": max(r["max_param_diff"] for r in per_rank),
    }


# --------------------------------------------------------------------------------------------------


def committed_results() -> dict[str, dict]:
    """The committed runs of this benchmark, by backend: "gloo" from data/results/cpu-gloo/, "nccl"
    from any GPU's folder (absent until a machine with several GPUs has run it)."""
    found = {}
    gloo = bench.RESULTS_DIR / "cpu-gloo" / "08_communication.json"
    if gloo.exists():
        found["gloo"] = json.loads(gloo.read_text())
    for path in sorted(bench.RESULTS_DIR.glob("*/08_communication_nccl.json")):
        found["nccl"] = json.loads(path.read_text())
        found["nccl"]["path"] = str(path.relative_to(bench.RESULTS_DIR.parents[1]))
    return found


def committed_ring_target(backend: str = "gloo") -> tuple[dict | None, str]:
    """(the committed `--ring` run of `backend`, its path), or (None, "") where there is none:
    gloo's in data/results/cpu-<cores>core/, NCCL's in a GPU's folder."""
    pattern = "cpu-*core/08_communication_ring.json"
    if backend == "nccl":
        pattern = "*/08_communication_ring_nccl.json"
    found = sorted(bench.RESULTS_DIR.glob(pattern))
    if not found:
        return None, ""
    path = found[-1]
    return json.loads(path.read_text()), str(path.relative_to(bench.RESULTS_DIR.parents[1]))


def _prediction(p: cost_model.OverlapPrediction) -> dict:
    return {**p.__dict__, "hidden_fraction": p.hidden_fraction}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes only, nothing written")
    p.add_argument("--ring", action="store_true", help="the ring's target only (see above)")
    p.add_argument("--repeats", type=int, default=3, help="--ring: fresh process groups per N")
    args = p.parse_args(argv)
    backend = launch.default_backend(2)
    if args.ring:
        run_ring_target(backend, args.repeats)
        return
    big = [4 * 1024, 64 * 1024, MiB, 16 * MiB, 64 * MiB]
    sizes = {
        2: [4 * 1024, 64 * 1024, MiB] if args.quick else big,
        4: [4 * 1024, 64 * 1024, MiB] if args.quick else big[:4],
    }
    results = {"environment": environment(backend)}
    started = time.perf_counter()
    results["point_to_point"] = pp = measure_alpha_beta(backend=backend)
    print(
        f"point to point: alpha {pp['alpha_s'] * 1e6:.0f} us, beta {pp['beta_bps'] / 1e9:.2f} GB/s"
    )
    results["all_reduce"] = rows = []
    for world in (2, 4):
        if backend == "nccl" and torch.cuda.device_count() < world:
            continue
        reps = 5 if args.quick else 9
        rows += all_reduce_sweep(world, sizes[world], reps, backend=backend)
    for r in rows:  # the alpha-beta ring from the point-to-point fit, beside each measurement
        r["predicted_ring_s"] = cost_model.ring_time(
            r["bytes"], r["world"], pp["alpha_s"], pp["beta_bps"]
        )
    for r in rows:
        print(
            f"all-reduce N={r['world']} {r['bytes'] / MiB:8.3f} MiB {r['impl']:5s} "
            f"{r['median_s'] * 1e3:8.2f} ms  busbw {r['busbw_gbps']:.3f} GB/s"
        )
    results["ddp"] = {}
    for label, wait_s in (("cpu backward", 0.0), ("waiting backward", DDP_WAIT_S)):
        d = ddp_steps(backend=backend, steps=4 if args.quick else 12, wait_s=wait_s)
        # backward is about 2/3 of forward + backward (two products per forward product), plus its
        # waits
        compute = d["step_median_s"]["compute only"]
        backward = 2 / 3 * (compute - 4 * wait_s) + 4 * wait_s
        d["predicted"] = {
            "backward_s": backward,
            **{
                name: _prediction(
                    cost_model.overlap(buckets, backward, 2, pp["alpha_s"], pp["beta_bps"])
                )
                for name, buckets in (
                    ("overlapped", d["bucket_bytes"]),
                    ("per parameter", d["param_bytes"]),
                )
            },
        }
        results["ddp"][label] = d
        for name, t in d["step_median_s"].items():
            print(f"DDP N=2 {label}: {name:20s} {t * 1e3:7.1f} ms")
        print(f"  hidden: { {k: round(v, 2) for k, v in d['hidden_fraction'].items()} }")
    results["optimizer_state"] = [optimizer_state(w) for w in (2, 4)]
    for o in results["optimizer_state"]:
        print(
            f"sharded AdamW N={o['world']}: largest shard {o['largest_shard_fraction']:.3f} "
            f"of {o['full_bytes'] / MiB:.2f} MiB"
        )
    results["elapsed_s"] = time.perf_counter() - started
    results["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if not args.quick:
        if backend == "nccl":
            path = bench.save_results("08_communication_nccl", results)
        else:
            path = bench.save_results("08_communication", results, gpu_slug="cpu-gloo")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
