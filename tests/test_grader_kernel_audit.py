"""The kernel audit (grading/kernel_audit.py): ncu's list read strictly, kernels attributed by the
grader's markers, library kernels named; on a GPU, a function that computes with PyTorch loses its
points even where the in-process watch was told it passed, and an honest one keeps them."""

import fcntl
import functools
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from grading import kernel_audit
from grading.kernel_audit import AuditError, kernels_between_markers, library_of, parse_ncu_csv
from grading.labs import get_lab

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","launch__grid_size"')
UNITS = '"","","","","","","","","","","",""'


def row(i: int, name: str, grid: int) -> str:
    return (f'"{i}","1095","python3.12","127.0.0.1","{name}","1","7","(256, 1, 1)",'
            f'"({grid}, 1, 1)","0","9.0","{grid:,}"')


def ncu_log(*launches: tuple[str, int]) -> str:
    lines = ["==PROF== Connected to process 1095 (/usr/bin/python3.12)",
             HEADER, UNITS, *(row(i, n, g) for i, (n, g) in enumerate(launches)),
             "==PROF== Disconnected from process 1095"]
    return "\n".join(lines) + "\n"


ADD_ATEN = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,"
            " std::array<char *, 3>>(int, T2, T3)")
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char *, 1>>(int, T2, T3)")
COPY = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase &)::[lambda() (instance 3)]::operator ()() const>(int, T1)")
SPIN = "void at::cuda::<unnamed>::spin_kernel(long)"


@pytest.mark.parametrize("name, library", [
    (ADD_ATEN, "PyTorch"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>(T3)", "PyTorch"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "cuBLAS"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "cuBLAS"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "cuDNN"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)",
     "PyTorch"),
    ("cupy_add__float32_float32_float32", "CuPy's built-in kernels"),
    ("triton_poi_fused_add_0", "torch.compile"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm>(T1::Params)", "CUTLASS"),
    # the student's own and the grader's bookkeeping
    ("add_kernel", None), ("grouped_gemm_kernel", None), ("_rms_norm_fwd", None),
    ("flash_attention_forward", None), (FILL, None), (COPY, None), (SPIN, None),
    (kernel_audit.MARKER, None),
])
def test_library_kernels_are_named_and_the_students_are_not(name, library):
    assert library_of(name) == library


def test_each_function_gets_the_kernels_between_its_markers():
    m = kernel_audit.MARKER
    log = ncu_log(("void at::native::x<CUDAFunctor_add<float>>", 1), (m, 1), (FILL, 8),
                  ("add_kernel", 64), (m, 2), (FILL, 8), (ADD_ATEN, 128), (m, 3))
    seen = kernels_between_markers(parse_ncu_csv(log), ["add", "residual_add"])
    assert seen == {"add": [FILL, "add_kernel"], "residual_add": [FILL, ADD_ATEN]}
    assert [library_of(k) for k in seen["residual_add"]] == [None, "PyTorch"]


GRAPH = kernel_audit.GRAPH_LAUNCH
CALL, CAPTURE, REPLAY = kernel_audit.CALL, kernel_audit.CAPTURE, kernel_audit.REPLAY


def test_a_graph_replay_is_its_own_segment_of_the_list():
    """A function the lab captures in a CUDA graph has three segments: its call, its capture
    (the warm-up call: kernels; the capture: nothing), the replay (copies, fills, the graph)."""
    m = kernel_audit.MARKER
    log = ncu_log((m, 1), (FILL, 8), ("argmax_kernel", 4), (m, 2), ("argmax_kernel", 4), (m, 3),
                  (COPY, 8), (FILL, 8), (GRAPH, 1), (m, 4))
    labels = [("argmax", CALL), ("argmax", CAPTURE), ("argmax", REPLAY)]
    seen = kernels_between_markers(parse_ncu_csv(log), labels)
    assert seen[("argmax", REPLAY)] == [COPY, FILL, GRAPH]
    report, done = {"functions": {}}, {"argmax": {"status": "pass", "points": 3}}
    kernel_audit.judge_seen(report, ["argmax"], done, seen, {})
    assert done["argmax"] == {"status": "pass", "points": 3}
    assert report["functions"]["argmax"]["graph_replay"] == [COPY, FILL, GRAPH]


@pytest.mark.parametrize("seen, why", [
    # the replay's outputs computed eagerly, no graph launched
    ({CALL: ["k"], CAPTURE: ["k"], REPLAY: [COPY, FILL, "k"]}, "saw no CUDA graph launched"),
    # a graph launched for show, the outputs computed beside it
    ({CALL: ["k"], CAPTURE: ["k"], REPLAY: [COPY, FILL, GRAPH, "k"]}, "outside the CUDA graph"),
    ({CALL: ["k"], CAPTURE: ["k"], REPLAY: [COPY, "k", FILL, GRAPH]}, "outside the CUDA graph"),
    # a graph launched inside the call hides its kernels from the list
    ({CALL: [FILL, GRAPH]}, "CUDA graph launched inside its call"),
    ({CALL: ["k"], CAPTURE: [GRAPH], REPLAY: [GRAPH]}, "CUDA graph launched inside its call"),
    # PyTorch in the warm-up call before the capture
    ({CALL: ["k"], CAPTURE: [ADD_ATEN], REPLAY: [GRAPH]}, "saw kernels of PyTorch"),
])
def test_a_replay_that_is_not_the_graph_fails(seen, why):
    report, done = {"functions": {}}, {"f": {"status": "pass", "points": 3, "message": ""}}
    kernel_audit.judge_seen(report, ["f"], done, {("f", kind): k for kind, k in seen.items()}, {})
    assert done["f"]["status"] == "fail" and done["f"]["points"] == 0, done["f"]
    assert why in done["f"]["message"], done["f"]["message"]


TWO_MARKERS = ncu_log((kernel_audit.MARKER, 1), (kernel_audit.MARKER, 2))


@pytest.mark.parametrize("log, why", [
    ("==PROF== Disconnected\n", "0 kernel tables"),
    (ncu_log((kernel_audit.MARKER, 1)) + HEADER + "\n", "2 kernel tables"),
    (TWO_MARKERS.replace('"1095",', "", 1), "a row of 11 fields"),
    (TWO_MARKERS.replace('"(2, 1, 1)"', '"two"'), "would not write"),
    (TWO_MARKERS.replace('"1","1095"', '"0","1095"'), "out of order"),
])
def test_a_list_not_as_ncu_writes_it_is_refused(log, why):
    with pytest.raises(AuditError, match=why):
        kernels_between_markers(parse_ncu_csv(log), ["add"])


@pytest.mark.parametrize("grids", [[1], [1, 2, 2], [2, 1], [1, 3]])
def test_markers_missing_repeated_or_out_of_order_are_refused(grids):
    """A student's kernel named like the marker, or a marker launch the student's code suppressed,
    leaves the list unattributable: it counts against the functions, never for them."""
    log = ncu_log(*[(kernel_audit.MARKER, g) for g in grids])
    with pytest.raises(AuditError, match="markers came as grids"):
        kernels_between_markers(parse_ncu_csv(log), ["add"])


def test_functions_allowed_pytorch_or_process_groups_are_left_out():
    passed = {"status": "pass"}
    lab00 = get_lab("00_profiling")
    chosen, left_out = kernel_audit.audited_functions(
        lab00, {f.name: passed for f in lab00.functions})
    allowed = [f.name for f in lab00.functions if f.allowed_ops]
    assert allowed and all("may call PyTorch ops" in left_out[n] for n in allowed)
    assert [f.name for f in chosen] == [f.name for f in lab00.functions if not f.allowed_ops]
    lab08 = get_lab("08_communication")
    chosen, left_out = kernel_audit.audited_functions(
        lab08, {f.name: passed for f in lab08.functions})
    assert not chosen and all("process group" in why for why in left_out.values())
    lab01 = get_lab("01_elementwise_add")
    chosen, _ = kernel_audit.audited_functions(lab01, {"add": passed, "residual_add": {
        "status": "fail"}})
    assert [f.name for f in chosen] == ["add"]  # only what passed is audited


class _WorkerThatEnds:
    """Stands in for the audit's worker: it ends as `attempt` says before answering anything."""

    attempt = None

    def __init__(self, *args, **kwargs):
        for fd in kwargs.get("extra_fds", ()):
            os.close(fd)  # as WorkerProcess does once the worker has them

    def set_step(self, *args):
        pass

    def receive(self):
        from grading.protocol import WorkerGone

        raise WorkerGone(self.attempt)

    def close(self):
        pass


@pytest.mark.parametrize("stopped, points_kept", [("step", True), (None, False)],
                         ids=["stopped-by-a-limit", "exited-early"])
def test_a_worker_stopped_by_a_limit_leaves_the_audit_inconclusive(monkeypatch, tmp_path,
                                                                  stopped, points_kept):
    """ncu slows every launch (an autotuner's trial runs): a limit hit under it is no verdict
    either way. A worker that ends on its own before the list is complete counts against the
    functions, as any list that cannot be read does."""
    from grading import protocol
    from grading.protocol import Attempt, Options

    attempt = Attempt(returncode=0 if stopped is None else None, stopped=stopped,
                      step={"function": "add", "step": "kernel audit", "kind": "call",
                            "limit_s": 60.0})
    monkeypatch.setattr(_WorkerThatEnds, "attempt", attempt)
    monkeypatch.setattr(protocol, "WorkerProcess", _WorkerThatEnds)
    monkeypatch.setattr(kernel_audit, "status", lambda: (True, ""))
    monkeypatch.setattr(kernel_audit, "find_ncu", lambda: "/usr/bin/ncu")
    spec = get_lab("01_elementwise_add")
    done = {"add": {"status": "pass", "points": 4, "message": ""}}
    lab = {}
    kernel_audit.audit_lab(lab, spec, done, 3, Options(), {}, ["python"], tmp_path, False)
    assert lab["kernel_audit"]["waited_s"] >= 0 and lab["kernel_audit"]["seconds"] >= 0
    if points_kept:
        assert done["add"] == {"status": "pass", "points": 4, "message": ""}
        assert lab["kernel_audit"]["error"].startswith("inconclusive, the audit's worker was "
                                                       "stopped: did not finish within 60 s")
    else:
        assert (done["add"]["status"], done["add"]["points"]) == ("fail", 0)
        assert "could not be read (the audit's worker ended early: the grading process exited " \
               "with code 0" in done["add"]["message"], done["add"]["message"]


class _Reader:
    def join(self, timeout=None):
        pass


def test_an_early_worker_outlives_the_moment_its_thread_started_it(monkeypatch, tmp_path):
    """The worker is started with "die with parent", and its parent is the thread that started
    it: on the H200 a thread that ended right after the start killed every early worker
    (SIGKILL), and every audited function failed. The worker lives until close()."""
    from grading.protocol import Options, WorkerProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(kernel_audit, "status", lambda: (True, ""))

    def start_under_ncu(cmd, work, opts, env, sandboxed):
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        return WorkerProcess(sleeper, work, time.monotonic() + 60, opts), _Reader()

    monkeypatch.setattr(kernel_audit, "_start_under_ncu", start_under_ncu)
    early = kernel_audit.EarlyStart(["python"], tmp_path, Options(), {}, False)
    try:
        early.wait()
        time.sleep(1.0)
        assert early.worker.proc.poll() is None, f"the worker ended: {early.worker.proc.poll()}"
    finally:
        early.close()
    assert early.worker.proc.poll() is not None  # close() stopped it


def test_an_early_worker_holds_the_lock_and_is_the_one_the_audit_uses(monkeypatch, tmp_path):
    """EarlyStart starts the audit's worker (in a thread) when the lab's grading starts; from then
    until it is closed no other audit may run; the audit then calls that worker instead of
    starting one, and gives the audit's own time a fresh lab timeout."""
    from grading.protocol import Attempt, Options

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(kernel_audit, "status", lambda: (True, ""))
    started = []
    attempt = Attempt(returncode=None, stopped="step",
                      step={"function": "add", "step": "kernel audit", "kind": "call",
                            "limit_s": 60.0})
    monkeypatch.setattr(_WorkerThatEnds, "attempt", attempt)

    def start_under_ncu(cmd, work, opts, env, sandboxed):
        started.append(threading.current_thread().name)
        return _WorkerThatEnds(), _Reader()

    monkeypatch.setattr(kernel_audit, "_start_under_ncu", start_under_ncu)
    early = kernel_audit.EarlyStart(["python"], tmp_path, Options(), {}, False)
    early.wait()
    lock = tmp_path / f"course-kernel-audit-{os.getuid()}.lock"
    with open(lock, "a") as handle, pytest.raises(BlockingIOError):
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the early worker
    spec = get_lab("01_elementwise_add")
    done = {"add": {"status": "pass", "points": 4, "message": ""}}
    lab = {}
    kernel_audit.audit_lab(lab, spec, done, 3, Options(), {}, ["python"], tmp_path, False, early)
    assert early.worker.deadline > time.monotonic() + Options().timeout - 60
    early.close()
    assert started == ["ncu-audit-worker"]  # one worker, started by the thread, not the audit
    assert lab["kernel_audit"]["error"].startswith("inconclusive, the audit's worker was stopped")
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go of once closed


HOLD_THE_LOCK = """
import sys, time
from pathlib import Path
from grading.kernel_audit import one_audit_at_a_time
with one_audit_at_a_time(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_audits_run_one_at_a_time_across_threads_and_processes(tmp_path):
    """Two labs graded side by side (threads of one grader, or two graders) never run ncu at the
    same time, and a grader that dies holding the lock does not block the next."""
    lock = tmp_path / "audit.lock"
    acquired = threading.Event()

    def second_audit():
        with kernel_audit.one_audit_at_a_time(lock):
            acquired.set()

    with kernel_audit.one_audit_at_a_time(lock):  # another thread of this grader waits
        waiter = threading.Thread(target=second_audit, daemon=True)
        waiter.start()
        assert not acquired.wait(0.5)
    assert acquired.wait(10)
    waiter.join(10)

    acquired.clear()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(lock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        waiter = threading.Thread(target=second_audit, daemon=True)
        waiter.start()
        assert not acquired.wait(0.5)  # another grading process holds it
        holder.kill()  # killed mid-audit: flock lets go with the process
        assert acquired.wait(10)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.mark.cpu
def test_without_a_gpu_the_audit_says_why():
    assert kernel_audit.status() == (False, "no GPU")


def test_the_probe_runs_once_in_a_thread_holding_the_audit_lock(monkeypatch, tmp_path):
    """start_probe() finds whether ncu works while the first lab is graded; it must take the lock
    that keeps two ncu sessions apart, and status() must wait for it rather than probe again."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the lock file lands here
    lock_was_free, probes = [], []

    @functools.cache
    def probe():
        with open(tmp_path / f"course-kernel-audit-{os.getuid()}.lock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_was_free.append(True)
            except BlockingIOError:
                lock_was_free.append(False)
        probes.append(threading.current_thread().name)
        time.sleep(0.5)
        return True, "probed"

    monkeypatch.setattr(kernel_audit, "_probe", probe)
    monkeypatch.setattr(kernel_audit, "_probe_thread", None)
    kernel_audit.start_probe()
    kernel_audit.start_probe()
    deadline = time.monotonic() + 10
    while not probes and time.monotonic() < deadline:  # the thread is inside its probe
        time.sleep(0.01)
    assert kernel_audit.status() == (True, "probed")  # waits for the thread's answer
    kernel_audit._probe_thread.join(10)
    assert probes == ["ncu-probe"] and lock_was_free == [False]


# ---- on the GPU: ncu, the sandbox, the markers, end to end ----------------------------------

TORCH_ADD = """
import torch
import triton
import triton.language as tl


@triton.jit
def noop_kernel(x_ptr):
    pass


def add(a, b, out=None):
    noop_kernel[(1,)](a)
    return torch.add(a, b, out=out)


def residual_add(x, residual, out=None):
    return torch.add(x, residual, out=out)
"""


def audit(tmp_path, code: str, sandboxed: bool, lab: str = "01_elementwise_add"):
    from grading import runner
    from grading.protocol import Options, worker_env

    spec = get_lab(lab)
    work = tmp_path / "audit"
    work.mkdir(parents=True)
    (work / f"student_{spec.id}.py").write_text(code)
    done = {f.name: {"status": "pass", "points": f.points, "message": ""}
            for f in spec.functions if f.backend == "triton"}
    result = {}
    opts = Options(sandbox="auto" if sandboxed else "off")
    cmd = [sys.executable, "-m", "grading.worker", "--lab", spec.id, *opts.worker_args()]
    kernel_audit.audit_lab(result, spec, done, 11, opts, worker_env(opts), cmd, work,
                           sandboxed and runner.use_sandbox(opts)[0])
    return result["kernel_audit"], done


@pytest.mark.gpu
def test_on_a_gpu_ncu_lists_a_marker_from_a_python_process():
    assert kernel_audit.status() == (True, "")


@pytest.mark.gpu
@pytest.mark.parametrize("sandboxed", [True, False], ids=["bubblewrap", "no-sandbox"])
def test_pytorch_in_the_call_loses_the_points_the_watch_gave(tmp_path, sandboxed):
    """The in-process verdict is forged as "pass" here; ncu, outside the process, still sees
    PyTorch's add kernel in each function's call."""
    report, done = audit(tmp_path, TORCH_ADD, sandboxed)
    assert "error" not in report, report
    for name in ("add", "residual_add"):
        assert done[name]["status"] == "fail" and done[name]["points"] == 0
        assert "kernel audit: Nsight Compute" in done[name]["message"], done[name]["message"]
        assert "PyTorch" in done[name]["message"]
        library = report["functions"][name]["library"]
        assert library and all(library_of(k) == "PyTorch" for k in library), library
    assert "noop_kernel" in report["functions"]["add"]["kernels"]


@pytest.mark.gpu
def test_the_solution_passes_the_audit_with_its_own_kernels(tmp_path):
    from grading.notebooks import SOLUTIONS_DIR, read_notebook, solution_module

    nb = read_notebook(SOLUTIONS_DIR / "01_elementwise_add_lab.ipynb")
    code, _ = solution_module(nb, nb)
    report, done = audit(tmp_path, code, sandboxed=True)
    assert "error" not in report, report
    assert list(report["phase_seconds"]) == ["start", "import", "calls", "exit"], report
    for name, seen in report["functions"].items():
        assert done[name]["status"] == "pass", done[name]["message"]
        assert seen["kernels"] and not seen["library"], seen


@pytest.mark.gpu
def test_a_captured_call_passes_only_as_a_graph_replayed(tmp_path):
    """Lab 07's solution: ncu lists each graph function's replay as the grader's copies and fills
    and one graph launch. The same code with the grader's replay made eager (the outputs right,
    computed by the function itself, no graph launched) fails, and so does one that launches a
    graph for show beside the eager call."""
    from grading.notebooks import SOLUTIONS_DIR, read_notebook, solution_module

    nb = read_notebook(SOLUTIONS_DIR / "07_decoder_lab.ipynb")
    code, _ = solution_module(nb, nb)
    report, done = audit(tmp_path / "solution", code, sandboxed=True, lab="07_decoder")
    assert "error" not in report, report
    for name in ("rope", "argmax"):
        assert done[name]["status"] == "pass", done[name]["message"]
        replay = report["functions"][name]["graph_replay"]
        assert [k for k in replay if not kernel_audit.is_grader_kernel(k)] == [GRAPH], replay
    for shown, why in ((False, "saw no CUDA graph launched"), (True, "outside the CUDA graph")):
        forged = code + EAGER_REPLAY.replace("SHOW_A_GRAPH", str(shown))
        report, done = audit(tmp_path / f"eager-{shown}", forged, sandboxed=True, lab="07_decoder")
        for name in ("rope", "argmax"):
            assert done[name]["status"] == "fail", (name, done[name])
            assert why in done[name]["message"], done[name]["message"]


# The grader's capture kept, its replay replaced by the function called eagerly on the new values.
EAGER_REPLAY = """

import torch as _torch
import grading.graph as _graph

_capture = _graph.capture


def _keep(fn, spec, case, captured):
    call = _capture(fn, spec, case, captured)
    if not isinstance(call, str):
        call.eager = (fn, case.kwargs)
    return call


def _eager(call, replayed):
    for t, fresh in zip(call.inputs, replayed):
        t.copy_(fresh)
    fn, kw = call.eager
    fn(*call.inputs, **kw, out=_graph.out_argument(call.outs))
    if SHOW_A_GRAPH:
        call.graph.replay()
    _torch.cuda.synchronize()
    return call.outs


_graph.capture, _graph.replay = _keep, _eager
"""

