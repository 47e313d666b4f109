"""The memory budget judged from outside the worker (grading/gpu_memory.py): NVML's per-process
figure, read by the grading process around each budgeted call, decides over the worker's record.

On a CPU, NVML is a fake (`FakeNvml`): the tests script what it reports and check what the
grading process makes of it. The one GPU test reads the real driver.
"""

import os
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from grading import gpu_memory
from grading.cases import make_inputs
from grading.correctness import Judgement, LocalCaller, judge
from grading.gpu_memory import RESOLUTION, CallMemory, OutsideMemory
from grading.labs import get_lab
from grading.protocol import WorkerCaller, process_tree, record_to_dict
from kernels import runtime
from kernels.memory_profiling import triton_chunked_loss
from kernels.testing import generator

MiB = 2**20
LAB = get_lab("05_memory_profiling")
SPEC = LAB.function("token_losses")
CASE = SPEC.cases[0]  # one token: its budget is the 1 MiB floor
BUDGET = MiB
OUTSIDE_PHRASE = "as the grading process saw it through NVML, outside the process that ran it"
INSIDE_PHRASE = "MiB of device memory beyond its inputs and outputs at its peak"


class FakeNvml:
    """NVML as a test scripts it: `used` ({PID: bytes}, changed while a call runs), or why it
    cannot be read."""

    def __init__(self, used=None, why_not=""):
        self.used, self.why_not = dict(used or {}), why_not

    def used_by_process(self):
        return dict(self.used)


def honest_record(extra_bytes=None, outside=None):
    """A right call of the course's kernel on CASE, as the worker records it, with the memory
    figures the test sets; and its inputs."""
    inputs = make_inputs(SPEC, CASE, generator(7, runtime.DEVICE))
    caller = LocalCaller(triton_chunked_loss.token_losses)
    caller.begin_case(SPEC, CASE, inputs)
    record = caller.call(0, inputs, profile=False)
    record.extra_bytes, record.outside_memory = extra_bytes, outside
    return record, inputs


def judged(record, inputs):
    originals = tuple(t.clone() for t in inputs)
    return judge(Judgement(SPEC, CASE, inputs, originals, record, 7, 0, None))


def test_a_forged_record_is_judged_on_the_outside_figure():
    """extra_bytes 0 from the worker, 300 MiB of growth seen from outside: the case fails, and
    the reason gives the outside figure. Without the outside figure the same record passes."""
    record, inputs = honest_record(extra_bytes=0)
    assert judged(record, inputs).ok
    record.outside_memory = OutsideMemory(growth=300 * MiB, own=0, samples=40)
    result = judged(record, inputs)
    assert not result.ok
    assert "grew by 300.0 MiB" in result.reason and OUTSIDE_PHRASE in result.reason, result.reason
    assert f"at most {(BUDGET + RESOLUTION) / MiB:.1f} MiB" in result.reason


def test_an_honest_call_within_its_budget_passes():
    record, inputs = honest_record(extra_bytes=BUDGET // 2,
                                   outside=OutsideMemory(growth=2 * MiB, own=0, samples=40))
    result = judged(record, inputs)
    assert result.ok, result.reason


def test_the_outside_check_abstains_within_its_resolution():
    """Over the budget by less than NVML can resolve (the allocator's rounding): the worker's
    figure decides, forged or not; one MiB more and the outside figure decides."""
    own = 8 * MiB
    edge = BUDGET + own + RESOLUTION
    record, inputs = honest_record(extra_bytes=0, outside=OutsideMemory(growth=edge, own=own))
    assert judged(record, inputs).ok
    record.extra_bytes = 2 * BUDGET  # an honest worker's own count over the budget still fails
    assert INSIDE_PHRASE in judged(record, inputs).reason
    record.extra_bytes = 0
    record.outside_memory.growth = edge + MiB
    assert OUTSIDE_PHRASE in judged(record, inputs).reason


def test_the_memory_of_the_root_s_descendants_counts_and_no_other_process_s():
    """A grandchild's memory is the worker's (a helper process cannot hide it); the memory of a
    process outside the tree (this one) is not."""
    code = ("import subprocess, sys; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).wait()")
    root = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 30
        while len(tree := process_tree(root.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        grandchild = tree[-1]
        assert grandchild != root.pid
        nvml = FakeNvml({grandchild: 100 * MiB, os.getpid(): 5000 * MiB})
        with CallMemory(nvml, root.pid, own=0) as watch:
            assert watch.tree_bytes() == 100 * MiB
            nvml.used[grandchild] += 300 * MiB
            nvml.used[os.getpid()] += 1000 * MiB
            time.sleep(0.02)
        assert watch.observed.growth == 300 * MiB and watch.observed.samples > 2
    finally:
        for pid in process_tree(root.pid)[1:]:
            os.kill(pid, signal.SIGKILL)
        root.kill()
        root.wait()


def test_a_peak_given_back_before_the_reply_is_seen():
    """Sampled every millisecond: memory reserved, then freed (`empty_cache`) before the call
    returns, is still growth."""
    nvml = FakeNvml({os.getpid(): 50 * MiB})
    with CallMemory(nvml, os.getpid(), own=0) as watch:
        nvml.used[os.getpid()] = 10 * MiB  # the cache emptied first: the lowest reading
        time.sleep(0.03)
        nvml.used[os.getpid()] = 700 * MiB
        time.sleep(0.03)
        nvml.used[os.getpid()] = 10 * MiB
    assert watch.observed.growth == 690 * MiB


class FakeWorker:
    """The worker as `WorkerCaller` sees it: a call's reply is `record` (forged as the student's
    code would), and while it is made the GPU memory of its process (this one, in the fake NVML)
    rises by `rise` bytes."""

    def __init__(self, folder, record, nvml, rise):
        self.folder, self.record, self.nvml, self.rise = folder, record, nvml, rise
        self.proc = types.SimpleNamespace(pid=os.getpid())
        self.call_seconds = {}  # WorkerCaller times its round trips into it

    def request(self, message):
        if message["op"] != "call":
            return {}
        if os.getpid() in self.nvml.used:
            self.nvml.used[os.getpid()] += self.rise
        time.sleep(0.02)
        forged = record_to_dict(self.record)
        forged["outside_memory"] = {"growth": 0}  # a figure of its own: never read
        torch.save(forged, self.folder / "record-1.pt")
        return {"record": "record-1.pt"}


def test_the_grading_process_reads_memory_around_a_worker_s_call(tmp_path):
    """Through `WorkerCaller`: the worker's record says 0 bytes (and offers an outside figure of
    its own); the growth the caller observed is what the verdict reads."""
    forged, inputs = honest_record(extra_bytes=0)
    nvml = FakeNvml({os.getpid(): 10 * MiB})
    caller = WorkerCaller(FakeWorker(tmp_path, forged, nvml, 400 * MiB), tmp_path,
                          "token_losses", None, nvml)
    caller.begin_case(SPEC, CASE, inputs)
    record = caller.call(0, inputs, profile=False)
    assert isinstance(record.outside_memory, OutsideMemory)
    assert record.outside_memory.growth == 400 * MiB
    assert OUTSIDE_PHRASE in judged(record, inputs).reason
    # the profiled call is left to the worker's figure: CUPTI maps buffers of its own inside it
    assert caller.call(0, inputs, profile=True).outside_memory is None


def test_without_nvml_the_worker_s_figure_decides_and_the_report_says_so(monkeypatch):
    """No NVML (no GPU, pynvml missing, another PID namespace): the observation says why, the
    verdict is the worker's, and the lab's notes state it."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert "pynvml is not installed" in gpu_memory.Nvml().why_not
    missing = FakeNvml(why_not="pynvml is not installed (pip install nvidia-ml-py)")
    with CallMemory(missing, os.getpid(), own=0) as watch:
        pass
    assert watch.observed.growth is None and "pynvml" in watch.observed.why_not
    record, inputs = honest_record(extra_bytes=0, outside=watch.observed)
    assert judged(record, inputs).ok  # forged or not, the worker's 0 stands
    record.extra_bytes = 300 * MiB
    assert INSIDE_PHRASE in judged(record, inputs).reason
    note = gpu_memory.budget_note(LAB, missing)
    assert "figure the worker reported only" in note and "pynvml is not installed" in note
    assert gpu_memory.budget_note(get_lab("01_elementwise_add"), missing) is None  # no budget
    assert gpu_memory.budget_note(LAB, FakeNvml()) is None


def test_a_worker_nvml_does_not_list_is_not_observed_and_the_caller_says_why(tmp_path):
    """NVML readable, but none of the worker's processes in its list (the grading process in a
    container whose process IDs are not the driver's): nothing observed, the worker's figure
    decides, and the caller keeps the reason for the lab's notes."""
    nvml = FakeNvml({1: 10 * MiB})  # init's, never a worker's
    forged, inputs = honest_record(extra_bytes=0)
    caller = WorkerCaller(FakeWorker(tmp_path, forged, nvml, 0), tmp_path, "token_losses", None,
                          nvml)
    caller.begin_case(SPEC, CASE, inputs)
    record = caller.call(0, inputs, profile=False)
    assert record.outside_memory.growth is None
    assert "lists no process" in caller.unobserved
    assert judged(record, inputs).ok


@pytest.mark.gpu
def test_nvml_sees_a_child_process_reserve_gpu_memory():
    """The real driver: a process that reserves 512 MiB while the grading process watches."""
    nvml = gpu_memory.shared_nvml()
    assert not nvml.why_not, nvml.why_not
    code = ("import sys, torch; torch.zeros(1, device='cuda'); print('ready', flush=True); "
            "sys.stdin.readline(); x = torch.empty(512 * 2**20, dtype=torch.uint8, "
            "device='cuda'); torch.cuda.synchronize(); print('done', flush=True); "
            "sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with CallMemory(nvml, child.pid, own=0) as watch:
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
        assert watch.observed.why_not == "" and watch.observed.samples > 1
        assert 512 * MiB <= watch.observed.growth <= 512 * MiB + RESOLUTION
    finally:
        child.kill()
        child.wait()
