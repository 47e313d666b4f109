"""A process group whose every message passes through the process that started it (lab 08).

    found = ranks.run_forked(body, fn, groups)                      # a check cell
    found = ranks.run_spawned(folder, name, groups, sandboxed=True)   # python -m grading

Each of `groups` is `(job, per_rank, gates)`: `body(fn, rank, world, job, per_rank[rank])` runs in
each of its len(per_rank) ranks and returns what it produced; `per_rank[r]` is the only input rank
r is given. `found` holds per group {"ranks": [what each body returned], "log": [...]}, or
{"error": why, "log": [...]}, or {"not_implemented": True, ...}.

Each rank is a process of its own. Under `python -m grading` it is a fresh interpreter
(`python -m grading.ranks`) in a sandbox of its own (grading/sandbox.py: its own folder, /tmp,
network and PID namespace), which imports the graded module itself and is handed its own inputs
over its own socket: no process a rank can read holds another rank's inputs. The check cells fork
the ranks from the notebook instead, so that a function defined there runs as it is.

The ranks' `torch.distributed` is `RelayGroup`, a process group written in Python: every send,
receive and collective is a message to the `Relay`, which runs in the starting process (the
grader's own, which never runs the student's code). The relay delivers the messages, does the
collectives' arithmetic, and writes down what it saw: who sent how many elements to whom, which
collectives each rank called and with what, when each rank waited, and where each rank's
`gate()` fell among its messages. A verdict on the topology or the overlap reads that log, never a
rank's own account. What each body returns is data, checked field by field by the caller.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

MESSAGE_LIMIT = 64 * 2**20  # bytes: a rank's message larger than this is refused unread
# What one group may pass through the relay, which holds it in memory: lab 08's groups move a few
# MiB in a few thousand messages.
RELAY_BYTES, RELAY_MESSAGES = 512 * 2**20, 200_000
TIMEOUT_S = 60.0  # a whole group, from the ranks' start: a rank computing forever
# What each collective is called in torch.distributed (the relay offers the first three).
LIBRARY = {
    "allreduce": "dist.all_reduce",
    "broadcast": "dist.broadcast",
    "barrier": "dist.barrier",
    "allreduce_coalesced": "dist.all_reduce_coalesced",
    "reduce": "dist.reduce",
    "allgather": "dist.all_gather",
    "_allgather_base": "dist.all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "dist.all_gather_into_tensor",
    "reduce_scatter": "dist.reduce_scatter",
    "_reduce_scatter_base": "dist.reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "dist.reduce_scatter_tensor",
    "alltoall": "dist.all_to_all",
    "alltoall_base": "dist.all_to_all_single",
    "gather": "dist.gather",
    "scatter": "dist.scatter",
}
_REDUCE = {"SUM": torch.sum, "AVG": torch.mean, "PRODUCT": torch.prod,
           "MIN": lambda x, dim: x.min(dim).values, "MAX": lambda x, dim: x.max(dim).values}


class RankError(Exception):
    """Raised by a body for the student's error: its message is the reason, as it is."""


def _pack(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(data: bytes):
    """A message as data only (`weights_only`: tensors, numbers, strings, lists, dicts)."""
    return torch.load(io.BytesIO(data), weights_only=True)


# --------------------------------------------------------------------------------------------------
# In each rank


class _Work(dist._Work):
    """A request whose answer is fetched from the relay when it is waited for (at most once)."""

    def __init__(self, fetch=None):
        super().__init__()
        self.fetch = fetch

    def wait(self, timeout=None) -> bool:
        if self.fetch is not None:
            fetch, self.fetch = self.fetch, None
            fetch()
        return True

    def is_completed(self) -> bool:
        return self.fetch is None

    def is_success(self) -> bool:
        return True


class RelayGroup(dist.ProcessGroup):
    """torch.distributed's backend in a rank: each operation is a message to the relay."""

    def __init__(self, rank: int, world: int, conn: Connection):
        super().__init__(rank, world)
        self.conn, self.collectives = conn, 0

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "relay"

    def tell(self, message: dict) -> None:
        self.conn.send_bytes(_pack(message))

    def ask(self, message: dict) -> dict:
        self.tell(message)
        reply = _unpack(self.conn.recv_bytes())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def send(self, tensors, dstRank, tag):  # noqa: N803 - torch's names
        self.tell({"op": "send", "peer": int(dstRank), "tag": int(tag),
                   "tensor": tensors[0].detach().clone()})
        return _Work()

    def _receive(self, tensor, peer: int, tag: int) -> _Work:
        def fetch():
            reply = self.ask({"op": "recv", "peer": peer, "tag": tag, "numel": tensor.numel(),
                              "dtype": str(tensor.dtype)})
            tensor.copy_(reply["tensor"].view_as(tensor))

        return _Work(fetch)

    def recv(self, tensors, srcRank, tag):  # noqa: N803
        return self._receive(tensors[0], int(srcRank), int(tag))

    def recv_anysource(self, tensors, tag):
        return self._receive(tensors[0], -1, int(tag))

    def _collective(self, op: str, tensor: torch.Tensor, **fields) -> _Work:
        index, self.collectives = self.collectives, self.collectives + 1
        self.tell({"op": op, "id": index, "tensor": tensor.detach().clone(), **fields})

        def fetch():
            tensor.copy_(self.ask({"op": "wait", "id": index})["tensor"])

        return _Work(fetch)

    def allreduce(self, tensors, opts=None):
        op = getattr(getattr(opts, "reduceOp", None), "op", None)
        name = getattr(op, "name", "SUM") if op is not None else "SUM"
        return self._collective("allreduce", tensors[0], reduce=name)

    def broadcast(self, tensors, opts=None):
        return self._collective("broadcast", tensors[0], root=int(opts.rootRank))

    def barrier(self, opts=None):
        return self._collective("barrier", torch.zeros(0))

    def gate(self) -> float:
        return float(self.ask({"op": "gate"})["value"])

    def mark(self, label: str) -> None:
        self.tell({"op": "mark", "label": str(label)})


def _refuse(name: str):
    def refused(self, *args, **kwargs):
        self.tell({"op": name, "id": -1})
        raise RuntimeError(f"{LIBRARY[name]} is not offered by the grader's process group "
                           f"(sends, receives, dist.all_reduce, dist.broadcast, dist.barrier)")

    return refused


for _name in set(LIBRARY) - {"allreduce", "broadcast", "barrier"}:
    setattr(RelayGroup, _name, _refuse(_name))

GROUP: RelayGroup | None = None  # this rank's group, while a body runs


def gate() -> float:
    """The relay's next gate value for this rank (what the grader hides until a rank gets there:
    lab 08's backward pass asks for it)."""
    return GROUP.gate()


def mark(label: str) -> None:
    """Label this rank's next messages in the relay's log (the case they belong to)."""
    GROUP.mark(label)


def _serve(conn: Connection, body, fn, header: dict) -> None:
    """Run `body` in a group whose messages go to the relay, and report how it ended."""
    global GROUP

    rank, world = int(header["rank"]), int(header["world"])
    torch.set_num_threads(1)  # the ranks share the machine's cores
    GROUP = RelayGroup(rank, world, conn)
    if not hasattr(dist.Backend, "RELAY"):  # once per process: a spawned rank serves groups
        dist.Backend.register_backend("relay", lambda *args: GROUP, devices=["cpu"])
    dist.init_process_group("relay", rank=rank, world_size=world, store=dist.HashStore())
    try:
        value = body(fn, rank, world, header["job"], header["inputs"])
        reply = {"op": "done", "value": value}
    except NotImplementedError:
        reply = {"op": "not_implemented"}
    except RankError as exc:
        reply = {"op": "error", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - raised outside the student's calls
        reply = {"op": "error", "message": _last_lines(exc)}
    dist.destroy_process_group()
    conn.send_bytes(_pack(reply))


def _last_lines(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return f"raised {text.splitlines()[-1] if text else type(exc).__name__}"


def _forked_rank(conn: Connection, body, fn) -> None:
    _serve(conn, body, fn, _unpack(conn.recv_bytes()))
    os._exit(0)  # nothing of the notebook's process runs its exit handlers twice


def main() -> None:
    """`python -m grading.ranks --fd N`, in the rank's folder: import the graded module from
    there, then serve the process groups the socket sends (a header each: lab, function, rank,
    world, this rank's inputs) until it closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    conn = Connection(parser.parse_args().fd)
    try:
        _serve_groups(conn)
    except Exception as exc:  # noqa: BLE001 - the grader's own failure, said where it is read
        conn.send_bytes(_pack({"op": "error", "message": f"the grader's rank process failed "
                                                         f"(a bug in the grader, not in your "
                                                         f"code): {_last_lines(exc)}"}))


def _serve_groups(conn: Connection) -> None:
    from grading.labs import get_lab
    from grading.notebooks import no_magics

    module = error = None
    while True:
        try:
            header = _unpack(conn.recv_bytes())
        except EOFError:
            return
        if module is None and error is None:
            path = Path.cwd() / f"student_{header['lab']}.py"
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            module.get_ipython = no_magics
            try:
                loader.loader.exec_module(module)
            except BaseException as exc:  # noqa: BLE001 - the graded module's: the worker names it
                error = f"importing the solution cells {_last_lines(exc)}"
        if error is not None:
            conn.send_bytes(_pack({"op": "error", "message": error}))
            continue
        spec = get_lab(header["lab"]).function(header["name"])
        _serve(conn, spec.run_group, getattr(module, header["name"], None), header)


# --------------------------------------------------------------------------------------------------
# In the process that starts the ranks


class Relay:
    """Delivers the ranks' messages and keeps the log. Single-threaded: a message is handled when
    it arrives, and a request is answered as soon as it can be."""

    def __init__(self, conns: list[Connection], gates: list[list[float]] | None,
                 timeout_s: float):
        self.conns, self.world = conns, len(conns)
        self.gates = gates or [[] for _ in conns]
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.log: list[dict] = []
        self.label = [""] * self.world
        self.mail: dict[tuple[int, int], list] = {}  # (from, to): [(tag, tensor)]
        self.waiting: dict[int, dict] = {}  # rank: the request it waits on
        self.collectives: dict[int, dict[int, dict]] = {}  # index: {rank: its message}
        self.results: dict[int, object] = {}  # index: the tensor every rank gets, or an error
        self.gates_passed = [0] * self.world
        self.ended: dict[int, dict] = {}  # rank: its last message (done, error, not implemented)
        self.held = 0  # bytes of tensors received (the relay keeps them: mail, results, log)

    def _note(self, rank: int, op: str, **fields) -> None:
        self.log.append({"rank": rank, "op": op, "label": self.label[rank], **fields})

    def _reply(self, rank: int, message: dict) -> None:
        self.waiting.pop(rank, None)
        try:
            self.conns[rank].send_bytes(_pack(message))
        except OSError:
            pass  # the rank is gone: its end is noticed when its socket closes

    def _handle(self, rank: int, msg) -> None:
        """One message of `rank`; a malformed one, or one past the group's budget, ends it."""
        try:
            self._handle_one(rank, msg)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            self.ended[rank] = {"op": "error", "message": f"rank {rank} sent the grader's "
                                                          f"process group a malformed message"}

    def _handle_one(self, rank: int, msg) -> None:
        op = msg.get("op") if isinstance(msg, dict) else None
        tensor = msg.get("tensor") if op else None
        if tensor is not None and type(tensor) is not torch.Tensor:
            op = "malformed"
        if tensor is not None:
            self.held += tensor.numel() * tensor.element_size()
        if self.held > RELAY_BYTES or len(self.log) > RELAY_MESSAGES:
            self.ended[rank] = {"op": "error", "message": (
                f"rank {rank} sent more than {RELAY_BYTES // 2**20} MiB or {RELAY_MESSAGES} "
                f"messages through the grader's process group")}
            return
        if op == "send":
            peer = int(msg["peer"])
            self.mail.setdefault((rank, peer), []).append((int(msg["tag"]), tensor))
            self._note(rank, "send", peer=peer, numel=tensor.numel(), dtype=str(tensor.dtype))
        elif op == "recv":
            self.waiting[rank] = msg
            self._note(rank, "recv", peer=int(msg["peer"]))
        elif op in LIBRARY:
            index = int(msg["id"])
            self._note(rank, op, id=index, tensor=tensor, gates=self.gates_passed[rank])
            if index >= 0:
                self.collectives.setdefault(index, {})[rank] = msg
                if len(self.collectives[index]) == self.world:
                    self.results[index] = self._reduce(index, self.collectives.pop(index))
        elif op == "wait":
            self.waiting[rank] = msg
            self._note(rank, "wait", id=int(msg["id"]), gates=self.gates_passed[rank])
        elif op == "gate":
            passed = self.gates_passed[rank]
            self._note(rank, "gate", index=passed)
            self.gates_passed[rank] += 1
            values = self.gates[rank]
            self._reply(rank, {"value": values[passed]} if passed < len(values) else
                        {"error": "the grader's gate was asked more often than backward runs"})
        elif op == "mark":
            self.label[rank] = str(msg["label"])[:200]
        elif op in ("done", "error", "not_implemented"):
            self.ended[rank] = msg
        else:
            self.ended[rank] = {"op": "error", "message": f"rank {rank} sent the grader's "
                                                          f"process group a malformed message"}

    def _reduce(self, index: int, calls: dict[int, dict]):
        """What collective `index` leaves in every rank, or why the ranks disagree."""
        first = calls[0]
        same = all(c["op"] == first["op"] and c["tensor"].shape == first["tensor"].shape
                   and c["tensor"].dtype == first["tensor"].dtype
                   and c.get("root") == first.get("root") and c.get("reduce") == first.get("reduce")
                   for c in calls.values())
        if not same:
            return {"error": f"collective {index}: the ranks called different collectives or "
                             f"passed tensors of different shapes or dtypes"}
        if first["op"] == "broadcast":
            root = first["root"]
            return calls[root]["tensor"] if root in calls else {"error": f"no rank {root}"}
        if first["op"] == "barrier":
            return first["tensor"]
        reduce = _REDUCE.get(first["reduce"])
        if reduce is None:
            return {"error": f"dist.ReduceOp.{first['reduce']} is not offered"}
        stacked = torch.stack([calls[r]["tensor"].double() for r in range(self.world)])
        return reduce(stacked, dim=0).to(first["tensor"].dtype)

    def _answer(self) -> None:
        """Answer every waiting request that can be answered now."""
        for rank, msg in list(self.waiting.items()):
            if msg["op"] == "wait":
                if int(msg["id"]) in self.results:
                    found = self.results[int(msg["id"])]
                    self._reply(rank, found if isinstance(found, dict) else {"tensor": found})
                continue
            peers = [int(msg["peer"])] if int(msg["peer"]) >= 0 else range(self.world)
            for peer in peers:
                box = self.mail.get((peer, rank), [])
                hit = next((i for i, (tag, _) in enumerate(box) if tag == int(msg["tag"])), None)
                if hit is None:
                    continue
                tensor = box.pop(hit)[1]
                if tensor.numel() != int(msg["numel"]) or str(tensor.dtype) != msg["dtype"]:
                    self._reply(rank, {"error": (
                        f"rank {rank} received {tensor.numel()} {tensor.dtype} elements from "
                        f"rank {peer} into a buffer of {msg['numel']} {msg['dtype']}: do a send "
                        f"and its receive disagree in size or dtype?")})
                else:
                    self._reply(rank, {"tensor": tensor})
                break

    def run(self, procs: list) -> dict:
        """Relay until every rank has ended; {"ranks": values} or {"error": why}, with the log.
        Every rank left waiting on a request nothing can answer, half a second with no message:
        a deadlock, or the peers of a rank that failed."""
        open_conns = dict(enumerate(self.conns))
        while len(self.ended) < self.world:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return self._error(f"did not finish within {self.timeout_s:.0f} s")
            live = [c for r, c in open_conns.items() if r not in self.ended]
            ready = wait(live, timeout=min(remaining, 0.5))
            if not ready:
                if all(r in self.waiting or r in self.ended for r in range(self.world)):
                    if any(e["op"] != "done" for e in self.ended.values()):
                        break  # the others wait for the one that failed
                    return self._error(
                        "every rank waits for a message that never comes: a receive whose send "
                        "never comes, or a collective not every rank calls? (do the steps of "
                        "every rank pair up?)")
                continue
            for conn in ready:
                rank = next(r for r, c in open_conns.items() if c is conn)
                try:
                    self._handle(rank, _unpack(conn.recv_bytes(MESSAGE_LIMIT)))
                except (EOFError, OSError, RuntimeError, ValueError, TypeError) as exc:
                    why = (f"it ended (exit status {_exit_status(procs[rank])})"
                           if isinstance(exc, EOFError) else "its message was too large or "
                                                              "malformed")
                    self.ended[rank] = {"op": "error",
                                        "message": f"rank {rank} of {self.world} died: {why}"}
                    del open_conns[rank]
            self._answer()
        return self._outcome()

    def _error(self, why: str) -> dict:
        return {"error": why, "log": self.log}

    def _outcome(self) -> dict:
        ends = [self.ended.get(r, {"op": "error", "message": f"rank {r} never finished"})
                for r in range(self.world)]
        if any(e["op"] == "not_implemented" for e in ends):
            return {"not_implemented": True, "log": self.log}
        errors = [str(e.get("message")) for e in ends if e["op"] != "done"]
        if errors:  # the cause before its symptoms: a rank that died takes its peers along
            errors.sort(key=lambda m: " died: " in m or "never finished" in m)
            return self._error(errors[0])
        return {"ranks": [e.get("value") for e in ends], "log": self.log}


def _exit_status(proc) -> int | None:
    time.sleep(0.05)  # a socket closes a moment before its process is reaped
    return proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode


def _stop(procs: list, conns: list) -> None:
    for conn in conns:
        conn.close()
    for proc in procs:
        if isinstance(proc, subprocess.Popen):
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        else:
            proc.kill()
            proc.join()


def _relay_groups(conns, procs, groups: list, name: str, timeout_s: float) -> list[dict]:
    """Each group `(job, per_rank, gates)` on the first len(per_rank) ranks, in order; after a
    group that ended in an error the ranks may be anywhere, so the later groups are not run."""
    found = []
    for job, per_rank, gates in groups:
        if found and "ranks" not in found[-1]:
            found.append({"error": "not run: an earlier process group failed", "log": []})
            continue
        world = len(per_rank)
        for r, inputs in enumerate(per_rank):
            conns[r].send_bytes(_pack({"lab": job.get("lab"), "name": name, "rank": r,
                                       "world": world, "job": job, "inputs": inputs}))
        found.append(Relay(conns[:world], gates, timeout_s).run(procs[:world]))
    return found


def run_forked(body, fn, groups: list, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Each group `(job, per_rank, gates)` in ranks forked from this process (a check cell: `fn`
    may be defined in the notebook), fresh for each group."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    found = []
    for job, per_rank, gates in groups:
        conns, procs = [], []
        try:
            for _ in per_rank:
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_forked_rank, args=(theirs, body, fn), daemon=True)
                proc.start()
                theirs.close()
                conns.append(mine)
                procs.append(proc)
            found += _relay_groups(conns, procs, [(job, per_rank, gates)], "", timeout_s)
        finally:
            _stop(procs, conns)
    return found


IMPORTS_GIB = 2.0  # a rank's address space before the student's code: PyTorch's, mostly (0.8)


def _in_child(memory_gib: float, then) -> None:  # pragma: no cover - in the child, before exec
    """The rank's memory cap: its imports and `memory_gib` (RLIMIT_AS, as the worker's)."""
    import resource

    cap = int((memory_gib + IMPORTS_GIB) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if then is not None:
        then()


def run_spawned(folder: Path, name: str, groups: list, *, sandboxed: bool,
                memory_gib: float = 8.0, env: dict | None = None, hidden=(),
                timeout_s: float = TIMEOUT_S, preexec_fn=None) -> list[dict]:
    """Each group `(job, per_rank, gates)` in fresh `python -m grading.ranks` processes, each in
    a folder of its own below `folder` holding a copy of the graded module `folder/student_<lab>.py`
    (in a sandbox of its own if `sandboxed`); the relay in this process. The processes of the
    largest group serve every group (a rank's imports, PyTorch's above all, take seconds).
    `preexec_fn` runs in each rank before it starts (the grader's: die with it)."""
    module = folder / f"student_{groups[0][0]['lab']}.py"
    conns, procs, extra, homes = [], [], [], []
    env = {**(env or os.environ), "KERNELS_MODE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    try:
        for rank in range(max(len(per_rank) for _, per_rank, _ in groups)):
            home = Path(tempfile.mkdtemp(prefix=f"rank{rank}-", dir=folder))
            homes.append(home)
            shutil.copyfile(module, home / module.name)
            mine, theirs = socket.socketpair()
            cmd = [sys.executable, "-m", "grading.ranks", "--fd", str(theirs.fileno())]
            fds = [theirs.fileno()]
            if sandboxed:
                from grading import sandbox

                info_r, info_w = os.pipe()
                extra.append(info_r)
                fds.append(info_w)
                cmd = sandbox.wrap(cmd, str(home), gpu=False, info_fd=info_w, hidden=hidden,
                                   tmpfs_bytes=int(memory_gib * 2**30))
            procs.append(subprocess.Popen(
                cmd, cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, pass_fds=fds, start_new_session=True,
                preexec_fn=functools.partial(_in_child, memory_gib, preexec_fn)))
            for fd in fds[1:]:
                os.close(fd)
            theirs.close()
            conns.append(Connection(mine.detach()))
        return _relay_groups(conns, procs, groups, name, timeout_s)
    finally:
        _stop(procs, conns)
        for fd in extra:
            os.close(fd)
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":  # the module as `grading.ranks`, the one the lab's bodies import
    from grading import ranks

    ranks.main()
