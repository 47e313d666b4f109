"""Start `world` processes joined in one process group, run a function in each, return its results.

    results = launch.run(worker, world=2, args=(x,))   # worker(rank, world, x) in each process

The backend follows the device: NCCL with one GPU per rank where `world` GPUs are visible, gloo with
CPU processes otherwise (`backend=` overrides). Every process group has a timeout, and so does the
wait for the processes: a rank that waits for a message that never comes (a send without its
receive) makes `run` raise after `timeout_s`, never hang.

Processes are forked for gloo: a forked child starts in milliseconds, shares the parent's imports
and can run a function defined in a notebook. CUDA cannot be used after a fork, so NCCL processes
are spawned instead, and so are gloo processes on a machine with a GPU, where the worker is
defined in a module: once this process has asked CUDA anything, a forked child that touches it
fails (torch.optim's step asks whether a graph is being captured), and after a backward pass
autograd's GPU threads do not survive a fork either. A spawned child imports the worker by name, so
a worker defined in a notebook cell is still forked; on a GPU machine it must stay off CUDA
entirely (no torch.optim step), or move into a `.py` file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60.0  # process group and join: a bug fails a test instead of hanging it


def default_backend(world: int) -> str:
    """NCCL where `world` GPUs are visible, gloo otherwise."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if dist.is_nccl_available() and gpus >= world else "gloo"


def device_for(rank: int, backend: str) -> torch.device:
    """Where rank `rank`'s tensors live: its own GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def importable(fn) -> bool:
    """Whether a spawned process can import `fn` by name: a function of a module, not of a
    notebook (`__main__`) nor nested in another function."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    return (
        module is not None
        and fn.__module__ != "__main__"
        and getattr(module, getattr(fn, "__qualname__", ""), None) is fn
    )


def _child(rank, world, rendezvous, backend, threads, worker, args, conn):
    try:
        if threads:
            torch.set_num_threads(threads)  # the ranks share the machine's cores
        device = device_for(rank, backend)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
            device_id=device if device.type == "cuda" else None,
        )
        try:
            conn.send(("ok", worker(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, with its traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def run(
    worker,
    world: int,
    args: tuple = (),
    *,
    backend: str | None = None,
    threads: int | None = None,
    timeout_s: float = TIMEOUT_S,
    start_method: str | None = None,
) -> list:
    """worker(rank, world, *args) in `world` processes of one process group; its return values by
    rank. `threads`: torch threads per process (default: the cores shared out, at least 1).
    Raises RuntimeError with the failing rank's traceback, or TimeoutError naming the ranks still
    waiting. `start_method`: "fork" or "spawn" (default: spawn for NCCL, and for gloo on a GPU
    machine where the worker can be imported; fork otherwise)."""
    backend = backend or default_backend(world)
    # torch.optim imports torch._dynamo when the first optimizer is built (seconds): do it once
    # here, so that forked children share it instead of each importing it on its own core
    import torch._dynamo  # noqa: F401

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    if start_method is None:
        gpu_here = torch.cuda.is_initialized() or torch.cuda.is_available()
        spawn = backend == "nccl" or (gpu_here and importable(worker))
        start_method = "spawn" if spawn else "fork"
    if start_method == "spawn" and not importable(worker):
        raise ValueError(
            f"launch.run: {getattr(worker, '__qualname__', worker)!r} is defined in a notebook or "
            f"inside a function, and {backend} ranks are spawned processes, which import their "
            "worker by name: define it in a .py file and import it"
        )
    ctx = mp.get_context(start_method)
    # The ranks meet through a file (torch's FileStore), not a TCP port: a port found free here
    # can be taken by another process before rank 0 listens on it (EADDRINUSE, seen when two test
    # runs shared a machine). The file must not exist yet; the folder goes when the run ends.
    folder = tempfile.TemporaryDirectory(prefix="launch-")
    rendezvous = os.path.join(folder.name, "rendezvous")
    pipes, procs = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(rank, world, rendezvous, backend, threads, worker, args, child_end),
            daemon=True,
        )
        p.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(p)
    results: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world:
            waiting = [r for r in range(world) if r not in results and r not in failures]
            for rank in waiting:
                if pipes[rank].poll(0.01):
                    try:
                        status, value = pipes[rank].recv()
                    except EOFError:
                        status, value = "error", f"exited with code {procs[rank].exitcode}"
                    if status == "error":
                        failures[rank] = f"rank {rank} of {world} failed:\n{value}"
                        # The other ranks fail soon after (their peer is gone): the first to
                        # report is not always the cause, so every report in the next 2 s is kept.
                        deadline = min(deadline, time.monotonic() + 2.0)
                    else:
                        results[rank] = value
                elif not procs[rank].is_alive() and not pipes[rank].poll(0):
                    code = procs[rank].exitcode
                    failures[rank] = f"rank {rank} of {world} died (exit code {code})"
                    deadline = min(deadline, time.monotonic() + 2.0)
            if failures and time.monotonic() > deadline:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {waiting} of {world} did not finish within {timeout_s:.0f} s: a send "
                    "without its matching receive, or a collective that not every rank called?"
                )
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for c in pipes:
            c.close()
        folder.cleanup()
    if failures:
        raise RuntimeError("\n".join(failures[rank] for rank in sorted(failures)))
    return [results[r] for r in range(world)]
