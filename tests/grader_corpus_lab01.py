"""Known-wrong and adversarial submissions for lab 01, and what the grader must say about each.

Each `Submission` edits solutions/01_elementwise_add_lab.ipynb: it replaces cells by grade_id (a
solution cell, or a locked cell to prove editing it changes nothing) and may delete cells. `expect`
gives, per graded function, the status and a phrase of the reason the grader must report on a GPU;
`cpu` overrides it where CPU mode (the Triton interpreter) behaves differently, and `gpu_only` says
why. Functions not listed are not checked for that submission. tests/test_grader_lab01.py grades
every one in a single `python -m grading` run and fails on any misclassification.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from grading.notebooks import BEGIN, END, grade_id, no_magics, read_notebook, solution_module

# --------------------------------------------------------------------------------------------------
# Building blocks: the solution's add cell, with a replaceable kernel tail and wrapper body.

ADD_KERNEL_HEADER = """
BLOCK = runtime.pick(gpu=4096, cpu=8192)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask)
    b = tl.load(b_ptr + offsets, mask=mask)
"""
CORRECT_STORE = (
    "    tl.store(out_ptr + offsets, (a.to(tl.float32) + b.to(tl.float32))"
    ".to(out_ptr.dtype.element_ty), "
    "mask=mask)\n"
)
CORRECT_LAUNCH = (
    "    n = out.numel()\n    if n:\n"
    "        add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)"
)
WRAPPER_HEAD = """

def add(a, b, out=None):
    check_elementwise("add", {"a": a, "b": b}, out, device_type=runtime.DEVICE)
    out = torch.empty_like(a) if out is None else out
"""


def add_cell(
    kernel_tail: str = CORRECT_STORE, wrapper_body: str = CORRECT_LAUNCH, prelude: str = ""
) -> str:
    return (
        prelude
        + ADD_KERNEL_HEADER
        + kernel_tail
        + WRAPPER_HEAD
        + wrapper_body
        + "\n    return out\n"
    )


# A Triton kernel that never ends: the loop condition is loaded from memory on every trip, after a
# store the compiler cannot move, so neither the interpreter nor the compiler can end it early.
SPIN_KERNEL = """
BLOCK = runtime.pick(gpu=4096, cpu=8192)


@triton.jit
def add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    again = tl.load(a_ptr) * 0 + 1.0
    while again > 0:
        tl.store(out_ptr, again)
        again = tl.load(b_ptr) * 0 + 1.0
"""

# Launched on a side stream; `synced` adds what a correct program does: the side stream waits for
# the inputs, PyTorch's stream waits for the result. In CPU mode there are no streams (stream(None)
# is a no-op).
SIDE_STREAM_LAUNCH = """    n = out.numel()
    side = torch.cuda.Stream() if runtime.ON_GPU else None
    if side is not None and SYNCED:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if n:
            add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)
    if side is not None and SYNCED:
        torch.cuda.current_stream().wait_stream(side)"""

RESIDUAL_WRONG_ORDER = """
@triton.jit
def residual_add_kernel(x_ptr, attn_ptr, mlp_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    attn = tl.load(attn_ptr + offsets, mask=mask).to(tl.float32)
    mlp = tl.load(mlp_ptr + offsets, mask=mask).to(tl.float32)
    partial = (attn + x).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (mlp + partial).to(out_ptr.dtype.element_ty), mask=mask)


def residual_add(x, attn, mlp, out=None):
    check_elementwise("residual_add", {"x": x, "attn": attn, "mlp": mlp}, out,
                      device_type=runtime.DEVICE)
    out = torch.empty_like(x) if out is None else out
    n = out.numel()
    if n:
        residual_add_kernel[(triton.cdiv(n, BLOCK),)](x, attn, mlp, out, n, BLOCK=BLOCK)
    return out
"""

# Correct on every correctness case (all < 1M elements), but caches its output for large inputs:
# only the timed repetitions, which change the inputs before every call, can catch it (GPU only).
CACHES_LARGE = """
    n = out.numel()
    key = (n, out.dtype)
    if n >= 1 << 20 and key in _CACHE:
        return out.copy_(_CACHE[key])
    if n:
        add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)
    if n >= 1 << 20:
        _CACHE[key] = out.clone()"""

PASS = ("pass", "")


def course_module_as(module: str, alias: str) -> str:
    """Code that loads the course's `module` again from its file under the name `alias` (its
    kernels then belong to a module that is not the course's, by name)."""
    return (f"import importlib.util\nimport {module} as _course\n"
            f"_spec = importlib.util.spec_from_file_location('{alias}', _course.__file__)\n"
            f"{alias} = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module({alias})")


RESIDUAL_STILL_GRADED = {"residual_add": PASS}  # a crash in add must not cost residual_add anything


@dataclass(frozen=True)
class Submission:
    cells: dict[str, str] = field(default_factory=dict)  # grade_id -> new source
    expect: dict[str, tuple[str, str]] = field(
        default_factory=dict
    )  # GPU mode (and CPU, unless `cpu`)
    cpu: dict[str, tuple[str, str]] | None = None  # CPU mode, where it differs
    notes: tuple[str, ...] = ()  # phrases that must appear among the lab's notes
    delete: tuple[str, ...] = ()  # grade_ids of cells to delete
    gpu_only: str = ""  # why CPU mode cannot show the failure
    diagnosis: str = ""  # a phrase the first failing function's message must also contain

    def expected(self, on_gpu: bool) -> dict[str, tuple[str, str]]:
        return self.expect if on_gpu or self.cpu is None else self.cpu


class SolutionCells:
    """A solution notebook's nbgrader cells by grade_id, and edits of them for a corpus: `edit`
    names text of the solution that must occur exactly once (so a change to the solution cannot
    quietly turn a mistake into a no-op), `solve_with` rewrites a wrapper's solution region. Each
    returns {grade_id: new source}."""

    def __init__(self, notebook: Path):
        self.notebook = notebook
        self.cells = {
            grade_id(c): c["source"] for c in read_notebook(notebook)["cells"] if grade_id(c)
        }

    def edit(self, cell: str, old: str, new: str) -> dict[str, str]:
        source = self.cells[cell]
        assert source.count(old) == 1, (
            f"{cell}: {old!r} occurs {source.count(old)} times in the solution"
        )
        return {cell: source.replace(old, new)}

    def region(self, cell: str) -> str:
        """The code of the cell's last solution region (the wrapper's, after the kernels'),
        dedented."""
        body = self.cells[cell].rpartition(BEGIN)[2].partition(END)[0]
        lines = body.split("\n")[1:-1]  # after BEGIN's line, before END's indentation
        indent = min(len(line) - len(line.lstrip(" ")) for line in lines if line.strip())
        return "\n".join(line[indent:] for line in lines)

    def solve_with(self, cell: str, code: str, prelude: str = "") -> dict[str, str]:
        """The cell with its last solution region's code replaced by `code` (and `prelude`,
        module-level code such as a cache, put in front of the cell)."""
        head, _, rest = self.cells[cell].rpartition(BEGIN)
        body, _, tail = rest.partition(END)
        first_line = body.split("\n")[1]
        indent = first_line[: len(first_line) - len(first_line.lstrip(" "))]
        return {
            cell: prelude
            + head
            + BEGIN
            + "\n"
            + "".join(indent + line + "\n" for line in code.splitlines())
            + indent
            + END
            + tail
        }

    def module(self, cells: dict[str, str], folder: Path):
        """The module the grader's worker would build from this solution with `cells`
        replaced, imported.
        Triton reads a kernel's source with inspect, so it is a real file, named as the
        worker names it
        (the grader locates an exception in the student's code by that name)."""
        source = read_notebook(self.notebook)
        student = copy.deepcopy(source)
        for cell in student["cells"]:
            cell["source"] = cells.get(grade_id(cell), cell["source"])
        code, _ = solution_module(student, source)
        path = folder / f"student_{self.notebook.stem.removesuffix('_lab')}.py"
        path.write_text(code)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        module.get_ipython = no_magics  # as the worker does
        spec.loader.exec_module(module)
        return module


CORPUS: dict[str, Submission] = {
    # ---- wrong results -------------------------------------------------------------------------
    # Launches n // BLOCK programs: the last partial block is never written.
    "wrong_on_tail": Submission(
        {
            "add": add_cell(
                wrapper_body=CORRECT_LAUNCH.replace("triton.cdiv(n, BLOCK)", "max(n // BLOCK, 1)")
            )
        },
        {
            "add": (
                "fail",
                "98765 float32: n=98765: 461 of 98765 elements wrong; first bad index 98304: "
                "expected",
            )
        },
        diagnosis="wrong for n not a multiple of the block size (n=98765, first bad index 98304): "
        "the last 461 "
        "elements are wrong (never written)",
    ),
    # Adds in float16 whatever the input: float32 results lose 13 bits.
    "lower_precision": Submission(
        {
            "add": add_cell(
                "    tl.store(out_ptr + offsets, (a.to(tl.float16) + b.to(tl.float16))"
                ".to(out_ptr.dtype.element_ty), mask=mask)\n"
            )
        },
        {"add": ("fail", "1 float32: n=1: 1 of 1 elements wrong")},
    ),
    "copies_an_input": Submission(
        {"add": add_cell(wrapper_body="    out.copy_(a)")}, {"add": ("fail", "elements wrong")}
    ),
    # ---- returns the wrong thing ---------------------------------------------------------------
    "returns_an_input": Submission(
        {"add": add_cell(wrapper_body="    return a")},
        {"add": ("fail", "it must write into out and return it (it returned its input a)")},
    ),
    "returns_torch_empty": Submission(
        {"add": add_cell(wrapper_body="    return torch.empty_like(a)")},
        {"add": ("fail", "it must write into out and return it (it returned another tensor)")},
    ),
    # Returns out without writing it: the NaN the grader poured in is still there.
    "never_writes": Submission(
        {"add": add_cell(wrapper_body="    pass")},
        {
            "add": (
                "fail",
                "no element was written (every one is still the NaN the grader put in out)",
            )
        },
    ),
    # ---- does not compute with its own kernel --------------------------------------------------
    "calls_torch_add": Submission(
        {"add": add_cell(wrapper_body="    torch.add(a, b, out=out)")},
        {
            "add": (
                "fail",
                "computes with PyTorch instead of its own kernel: torch.add (aten.add.out)",
            )
        },
    ),
    "calls_plus_operator": Submission(
        {"add": add_cell(wrapper_body="    out.copy_(a + b)")},
        {
            "add": (
                "fail",
                "computes with PyTorch instead of its own kernel: Tensor.add (aten.add.Tensor)",
            )
        },
    ),
    # Right values, computed by NumPy on the host: no kernel of its own, and a host round trip.
    "computes_on_host": Submission(
        {
            "add": add_cell(
                wrapper_body="    out.copy_(torch.from_numpy(a.cpu().numpy() + b.cpu().numpy()))"
            )
        },
        {"add": ("fail", "1 float32: moves tensors to the host inside the call (Tensor.numpy)")},
    ),
    # ---- state between calls, inputs, streams --------------------------------------------------
    "caches_outputs": Submission(
        {
            "add": add_cell(
                prelude="_CACHE = {}\n",
                wrapper_body="""    key = (tuple(out.shape), out.dtype)
    if key in _CACHE:
        return out.copy_(_CACHE[key])
"""
                + CORRECT_LAUNCH
                + "\n    _CACHE[key] = out.clone()",
            )
        },
        {
            "add": (
                "fail",
                "1 float32: called again with new values in the same input buffers: returned the "
                "previous call's result for new inputs: does it cache outputs between calls?",
            )
        },
    ),
    "mutates_an_input": Submission(
        {"add": add_cell(wrapper_body=CORRECT_LAUNCH + "\n    a.copy_(out)")},
        {"add": ("fail", "modified its input a")},
    ),
    "side_stream_unsynced": Submission(
        {"add": add_cell(prelude="SYNCED = False\n", wrapper_body=SIDE_STREAM_LAUNCH)},
        {
            "add": (
                "fail",
                "the output was not ready on PyTorch's current stream when the function returned",
            )
        },
        cpu={"add": PASS},
        gpu_only="the interpreter has no streams: the same code is correct on a CPU",
    ),
    # The same with the two waits a correct program has: no false alarm.
    "side_stream_synced": Submission(
        {"add": add_cell(prelude="SYNCED = True\n", wrapper_body=SIDE_STREAM_LAUNCH)}, {"add": PASS}
    ),
    # ---- the process: exceptions, hangs, memory, crashes, output -------------------------------
    "raises": Submission(
        {"add": add_cell(wrapper_body='    raise RuntimeError("boom")')},
        {"add": ("fail", "RuntimeError: boom"), **RESIDUAL_STILL_GRADED},
    ),
    "calls_sys_exit": Submission(
        {"add": add_cell(prelude="import sys\n", wrapper_body="    sys.exit(3)")},
        {
            "add": ("fail", "called sys.exit(3): a graded function must return its result"),
            **RESIDUAL_STILL_GRADED,
        },
    ),
    "exits_process": Submission(
        {"add": add_cell(prelude="import os\n", wrapper_body="    os._exit(0)")},
        {
            "add": (
                "error",
                "case 1 float32: the grading process exited with code 0 before it finished",
            ),
            **RESIDUAL_STILL_GRADED,
        },
    ),
    "infinite_loop_python": Submission(
        {"add": add_cell(wrapper_body="    while True:\n        pass")},
        {"add": ("error", "case 1 float32: did not finish within"), **RESIDUAL_STILL_GRADED},
    ),
    "infinite_loop_kernel": Submission(
        {"add": SPIN_KERNEL + WRAPPER_HEAD + CORRECT_LAUNCH + "\n    return out\n"},
        {"add": ("error", "case 1 float32: did not finish within"), **RESIDUAL_STILL_GRADED},
    ),
    # 256 MiB at a time, never touched: it counts against the host cap (address space) or the GPU
    # allocator's cap at once, so the loop ends in milliseconds.
    "allocates_until_oom": Submission(
        {
            "add": add_cell(
                wrapper_body="    hog = []\n    while True:\n"
                "        hog.append(torch.empty(1 << 28, dtype=torch.uint8, device=a.device))"
            )
        },
        {"add": ("fail", "1 float32: ran out of GPU memory"), **RESIDUAL_STILL_GRADED},
        cpu={"add": ("fail", "1 float32: ran out of host memory"), **RESIDUAL_STILL_GRADED},
        gpu_only="on the CPU the tensors are host memory: the host cap (RLIMIT_AS) stops it",
    ),
    # Stores 2**45 elements past the output: an unmapped address on any machine.
    "illegal_memory_access": Submission(
        {"add": add_cell("    tl.store(out_ptr + offsets + (1 << 45), a + b, mask=mask)\n")},
        {
            "add": (
                "error",
                "case 1 float32: CUDA error: an illegal memory access was encountered "
                "(an out-of-bounds "
                "read or write?)",
            ),
            **RESIDUAL_STILL_GRADED,
        },
        cpu={
            "add": (
                "error",
                "case 1 float32: the grading process crashed with SIGSEGV: an out-of-bounds memory "
                "access?",
            ),
            **RESIDUAL_STILL_GRADED,
        },
        gpu_only="the interpreter has no CUDA context: the store crashes the process (SIGSEGV) "
        "instead",
    ),
    "floods_stdout": Submission(
        {"add": add_cell(wrapper_body='    while True:\n        print("debug " * 100)')},
        {"add": ("error", "case 1 float32: printed more than"), **RESIDUAL_STILL_GRADED},
    ),
    # ---- the notebook and the grader themselves ------------------------------------------------
    "syntax_error": Submission(
        {"add": "def add(a, b, out=None:\n    pass\n"},
        {"add": ("error", "SyntaxError"), "residual_add": ("error", "SyntaxError")},
    ),
    "patches_the_grader": Submission(
        {
            "add": add_cell(
                prelude="import kernels.testing\nkernels.testing.compare = lambda *a, **k: None\n"
            )
        },
        {
            "add": ("error", "replaced part of the grader (kernels.testing.compare)"),
            "residual_add": ("error", "replaced part of the grader"),
        },
    ),
    # Locked cells are restored from the source: editing a check cell, raising in the setup cell or
    # deleting a check cell changes nothing, and each is reported.
    "edits_locked_cells": Submission(
        {"check_add": "print('PASS')", "setup": "raise SystemExit('no grading today')"},
        {"add": PASS, "residual_add": PASS},
        delete=("check_residual_add",),
        notes=(
            "locked cell check_add was modified (the grader used the original) (its nbgrader "
            "checksum does not match)",
            "locked cell setup was modified (the grader used the original)",
            "locked cell check_residual_add was deleted (the grader used the original)",
        ),
    ),
    # The other association, accumulated in float32: right to tolerance, wrong bits.
    "residual_wrong_order": Submission(
        {"residual_add": RESIDUAL_WRONG_ORDER},
        {"residual_add": ("fail", "not bit-identical to PyTorch"), "add": PASS},
    ),
}

# ---- submissions written to cheat, and honest code the grader once failed ---------------------
# One no-op launch beside the hidden PyTorch (a function must launch a kernel of its own).
NOOP_LAUNCH = "    add_kernel[(1,)](a, b, out, 0, BLOCK=BLOCK)\n"
THREAD_ADD = (
    "    import threading\n"
    "    worker = threading.Thread(target=lambda: torch.add(a, b, out=out))\n"
    "    worker.start()\n    worker.join()\n"
) + NOOP_LAUNCH
POOL_ADD = (
    "    from concurrent.futures import ThreadPoolExecutor\n"
    "    with ThreadPoolExecutor(1) as pool:\n"
    "        pool.submit(torch.add, a, b, out=out).result()\n"
) + NOOP_LAUNCH
UNWATCHED_ADD = (
    "    from torch.utils._python_dispatch import _disable_current_modes\n"
    "    with _disable_current_modes():\n"
    "        torch.add(a, b, out=out)\n"
) + NOOP_LAUNCH
# A pre-run hook adds; the launch itself (n = 0) writes nothing.
HOOK_ADD = (
    "    add_kernel.pre_run_hooks[:] = [lambda *args, **kwargs: torch.add(a, b, out=out)]\n"
    + NOOP_LAUNCH
    + "    add_kernel.pre_run_hooks[:] = []\n"
)
NUMPY_ADD = (
    "    import numpy\n"
    "    out.copy_(torch.from_numpy(numpy.add(a.cpu().numpy(), b.cpu().numpy())))\n"
) + NOOP_LAUNCH
# Returns a tensor subclass: a lazy result could compute its values when the grader reads them.
LAZY = "class Lazy(torch.Tensor):\n    pass\n"
LAZY_RETURN = CORRECT_LAUNCH + "\n    return torch.Tensor._make_subclass(Lazy, out)"
# A thread finishes the second half after the call returned (the old grader crashed diagnosing it).
# On a CPU the thread adds with PyTorch: Triton's interpreter keeps the running launch in global
# state, so two threads interpreting kernels at once can crash the worker (SIGSEGV, seen in CI),
# and the verdict would depend on which thread got there first.
LATE_HALF = """    n = out.numel()
    half = n // 2
    if half:
        add_kernel[(triton.cdiv(half, BLOCK),)](a, b, out, half, BLOCK=BLOCK)

    def rest():
        import time
        time.sleep(0.05)
        a_rest, b_rest, out_rest = a.view(-1)[half:], b.view(-1)[half:], out.view(-1)[half:]
        if n - half and runtime.ON_GPU:
            add_kernel[(triton.cdiv(n - half, BLOCK),)](a_rest, b_rest, out_rest, n - half,
                                                     BLOCK=BLOCK)
        elif n - half:
            torch.add(a_rest, b_rest, out=out_rest)

    import threading
    threading.Thread(target=rest).start()"""
# Wrong kernels that a fixed list of odd sizes did not catch.
SMALL_N_ONLY = CORRECT_LAUNCH.replace(
    "triton.cdiv(n, BLOCK)", "triton.cdiv(min(n, 100_000), BLOCK)"
)
ONE_PROGRAM_FOR_MULTIPLES = CORRECT_LAUNCH.replace(
    "[(triton.cdiv(n, BLOCK),)]", "[(1 if n % 8192 == 0 else triton.cdiv(n, BLOCK),)]"
)
EVEN_LAST = CORRECT_LAUNCH.replace("(a, b, out, n,", "(a, b, out, n - (n % 2 == 0),")
SKIPS_LAST_FULL_BLOCK = CORRECT_LAUNCH.replace(
    "triton.cdiv(n, BLOCK)", "triton.cdiv(n, BLOCK) - (n % 1024 == 0)"
)
THREE_D = CORRECT_LAUNCH.replace(
    "n = out.numel()", "n = out.shape[0] * out.shape[1] if out.dim() == 3 else out.numel()"
)
PAST_END = CORRECT_STORE.replace("mask=mask", "mask=offsets <= n")
ALLOCATES = "out = torch.empty_like(a) if out is None else out"
FLOAT64 = "out = torch.empty_like(a, dtype=torch.float64) if out is None else out"
A_ITSELF = "out = (a if a.element_size() == 2 else torch.empty_like(a)) if out is None else out"
# A continuation line that starts with %: Python, not a magic.
MODULO_CONTINUED = CORRECT_LAUNCH.replace(
    "n = out.numel()", "n = (out.numel()\n         % (1 << 62))"
)
GRADER_SETS = (
    "import grading.watch\ngrading.watch.ALLOWED_OPS = grading.watch.ALLOWED_OPS | "
    "{torch.ops.aten.add.out}\n"
)
TENSOR_NE = "torch.Tensor.__ne__ = lambda self, other: torch.zeros_like(self, dtype=torch.bool)\n"
RANDN_ZEROS = "torch.randn = lambda *args, generator=None, **kwargs: torch.zeros(*args, **kwargs)\n"
# At import: forged replies on every descriptor the worker may answer on, then the process ends.
# The parent takes the forged "import went fine" and "function found" at their word (they can only
# lose the student points), but a forged call reply names no record it could read and judge.
FORGED_REPLIES = """import json, os
for fd in range(3, 64):
    for i in range(1, 40):
        reply = {"id": i, "import_error": None, "changed": [], "kind": "function"}
        try:
            os.write(fd, (json.dumps(reply) + "\\n").encode())
        except OSError:
            break
os._exit(0)
"""

ATTACKS: dict[str, Submission] = {
    "forged_replies_then_exit": Submission(
        {"add": add_cell(prelude=FORGED_REPLIES)},
        {
            "add": (
                "error",
                "case 1 float32: the worker's reply could not be read (does the code write "
                "to the grader's channel?)",
            ),
            "residual_add": ("error", "case 1 float32: the worker's reply could not be read"),
        },
    ),
    "torch_in_a_thread": Submission(
        {"add": add_cell(wrapper_body=THREAD_ADD)},
        {
            "add": (
                "fail",
                "computes with PyTorch instead of its own kernel: aten.add.out (outside "
                "this thread's watch",
            )
        },
    ),
    "torch_in_a_thread_pool": Submission(
        {"add": add_cell(wrapper_body=POOL_ADD)},
        {"add": ("fail", "computes with PyTorch instead of its own kernel: aten.add.out")},
    ),
    "torch_with_modes_disabled": Submission(
        {"add": add_cell(wrapper_body=UNWATCHED_ADD)},
        {"add": ("fail", "computes with PyTorch instead of its own kernel: aten.add.out")},
    ),
    "torch_in_a_pre_run_hook": Submission(
        {"add": add_cell(wrapper_body=HOOK_ADD)},
        {
            "add": (
                "fail",
                "computes with PyTorch instead of its own kernel: torch.add (aten.add.out)",
            )
        },
    ),
    "numpy_round_trip": Submission(
        {"add": add_cell(wrapper_body=NUMPY_ADD)},
        {"add": ("fail", "moves tensors to the host inside the call (")},
    ),
    "lazy_subclass": Submission(
        {"add": add_cell(prelude=LAZY, wrapper_body=LAZY_RETURN)},
        {"add": ("fail", "returned a Lazy, not a plain torch.Tensor")},
    ),
    "patches_grader_sets": Submission(
        {"add": add_cell(prelude=GRADER_SETS, wrapper_body="    torch.add(a, b, out=out)")},
        {"add": ("error", "replaced part of the grader (grading.watch.ALLOWED_OPS)")},
    ),
    "patches_tensor_ne_writes_nothing": Submission(
        {"add": add_cell(prelude=TENSOR_NE, wrapper_body="    pass")},
        {"add": ("error", "replaced part of the grader (torch.Tensor.__ne__)")},
    ),
    "patches_randn_writes_zeros": Submission(
        {"add": add_cell(prelude=RANDN_ZEROS, wrapper_body="    out.zero_()")},
        {"add": ("fail", "elements wrong")},
    ),
    "correct_only_up_to_100000": Submission(
        {"add": add_cell(wrapper_body=SMALL_N_ONLY)}, {"add": ("fail", "elements wrong")}
    ),
    # One program for any multiple of 8192: right when n is exactly one block of 8192 (the CPU's),
    # so the drawn multiple is two blocks at least.
    "one_program_for_multiples_of_8192": Submission(
        {"add": add_cell(wrapper_body=ONE_PROGRAM_FOR_MULTIPLES)},
        {"add": ("fail", "elements wrong")},
    ),
    "last_element_unwritten_for_even_n": Submission(
        {"add": add_cell(wrapper_body=EVEN_LAST)}, {"add": ("fail", "elements wrong")}
    ),
    "last_block_skipped_for_multiples_of_1024": Submission(
        {"add": add_cell(wrapper_body=SKIPS_LAST_FULL_BLOCK)}, {"add": ("fail", "elements wrong")}
    ),
    "three_dimensions_mishandled": Submission(
        {"add": add_cell(wrapper_body=THREE_D)}, {"add": ("fail", "elements wrong")}
    ),
    "mask_writes_one_past_the_end": Submission(
        {"add": add_cell(PAST_END)}, {"add": ("fail", "wrote past the end of out")}
    ),
    "float64_result_without_out": Submission(
        {"add": add_cell().replace(ALLOCATES, FLOAT64)},
        {"add": ("fail", "called without out=: returned float64")},
    ),
    "returns_a_itself_for_16_bit": Submission(
        {"add": add_cell().replace(ALLOCATES, A_ITSELF)},
        {"add": ("fail", "called without out=: returned one of its inputs")},
    ),
    # honest code
    "continuation_line_starting_with_percent": Submission(
        {"add": add_cell(wrapper_body=MODULO_CONTINUED)}, {"add": PASS}
    ),
    # on a GPU the late launch races the grader's stream-ordered copy: "not ready on PyTorch's
    # current stream" or "elements wrong", a failure either way, never a grader error
    "finishes_writing_after_returning": Submission(
        {"add": add_cell(wrapper_body=LATE_HALF)},
        {"add": ("fail", "")},
        cpu={"add": ("fail", "elements wrong")},
    ),
}
# Computes with CuPy's built-in add (its kernel `cupy_add`, not a PyTorch op, so no op watcher sees
# it) beside one launch of its own kernel that writes nothing; bf16, which CuPy lacks, the honest
# way. Everything the worker watches passes: only the kernel audit (ncu, outside the process) sees
# whose kernel did the work.
CUPY_BUILTIN = """    n = out.numel()
    if n and runtime.ON_GPU and a.dtype != torch.bfloat16:
        import cupy

        add_kernel[(1,)](a, b, out, 0, BLOCK=BLOCK)  # n = 0: a launch that writes nothing
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            cupy.add(cupy.from_dlpack(a), cupy.from_dlpack(b), out=cupy.from_dlpack(out))
    elif n:
        add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)"""
ATTACKS["cupy_builtin_beside_a_launch_that_writes_nothing"] = Submission(
    {"add": add_cell(wrapper_body=CUPY_BUILTIN)},
    {"add": ("fail", "kernel audit: Nsight Compute, outside your code's process, saw kernels of "
                     "CuPy's built-in kernels")},
    cpu={"add": PASS},
    gpu_only="the CPU path launches its own kernel: CuPy runs only on a GPU",
)
# Correct only where it can read the course's answer key: the sandbox shows solutions/ empty, so it
# writes nothing (grading/sandbox.py; without bubblewrap the code runs with the user's rights).
ANSWER_KEY = """import pathlib

import kernels

_SOLUTIONS = pathlib.Path(kernels.__file__).resolve().parents[1] / "solutions"
_LEAKED = any(p.read_bytes() for p in _SOLUTIONS.glob("*_lab.ipynb"))
"""
ATTACKS["reads_the_answer_key"] = Submission(
    {"add": add_cell(prelude=ANSWER_KEY,
                     wrapper_body="    if _LEAKED:\n" + CORRECT_LAUNCH.replace("\n", "\n    ")
                     .replace("    n = out", "        n = out", 1))},
    {"add": ("fail", "elements wrong")},
)
# Computes with torch.add and rewrites what the worker reports of the call: the worker runs as
# __main__, and its record_to_dict is wrapped to clear the watchers' findings. Every fact the worker
# sends is the student's code's to change; only an observer outside its process (Nsight Compute, on
# a GPU) sees whose kernel ran. In CPU mode there is none: the limit grading/README.md counts.
FORGED_RECORD = """import sys

_worker = sys.modules["__main__"]
if hasattr(_worker, "record_to_dict"):
    _report = _worker.record_to_dict

    def _forged(record):
        record.watched.forbidden_ops, record.watched.triton_launches = [], 1
        record.watched.cuda_kernels = ["add_kernel"]
        return _report(record)

    _worker.record_to_dict = _forged
"""
ATTACKS["torch_add_behind_a_forged_record"] = Submission(
    {"add": add_cell(prelude=FORGED_RECORD, wrapper_body="    torch.add(a, b, out=out)")},
    {"add": ("fail", "kernel audit: Nsight Compute, outside your code's process, saw kernels of "
                     "PyTorch")},
    cpu={"add": PASS},
    gpu_only="in CPU mode nothing outside the worker sees which code ran: its records are the "
             "student's code's to forge",
)
CORPUS.update(ATTACKS)

# Graded with performance measurement (tests/test_grader_lab01.py::test_performance_*): only the
# timed repetitions, with inputs that change before each one, can catch these.
PERF_CORPUS: dict[str, Submission] = {
    "caches_large_outputs": Submission(
        {"add": add_cell(prelude="_CACHE = {}\n", wrapper_body=CACHES_LARGE)}, {"add": ("pass", "")}
    ),
}


# A correct add that launches its kernel three times (a third of the course's speed: tier F), each
# with a way to look faster that the worker's own timing believed. The course's kernel and the
# floor are timed in a clean worker, and both sides called back to back on the grading process's
# clock (grading/performance.py): every one gets F (tests/test_grader_lab01.py
# ::test_performance_is_judged_from_outside_the_student_s_worker, GPU).
THRICE = (
    "    n = out.numel()\n    for _ in range(3 if n else 0):\n"
    "        add_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK)"
)
SLOWS_THE_COURSE_KERNEL = """from kernels.elementwise_add import triton_add as _course

_course.add_kernel.pre_run_hooks.append(lambda *args, **kwargs: torch.cuda._sleep(2_000_000))
"""
ELAPSED_TIME_OVER = """_elapsed = torch.cuda.Event.elapsed_time
torch.cuda.Event.elapsed_time = lambda self, end: _elapsed(self, end) / {}
"""
FORGED_TIMING = """import sys

_worker = sys.modules["__main__"].Worker
_perf = _worker.op_perf


def _forged(self, req):
    reply = _perf(self, req)
    reply["result"]["times_us"] = [t / 3 for t in reply["result"]["times_us"]]
    return reply


_worker.op_perf = _forged
"""
SKIPS_THE_CALLS_TIMED_FROM_OUTSIDE = FORGED_TIMING + """_worker.op_wall_go = lambda self, req: {}
"""
OUTSIDE_CORPUS: dict[str, tuple[Submission, str]] = {  # name: (submission, a phrase of its note)
    "slows_the_course_kernel": (
        Submission({"add": add_cell(prelude=SLOWS_THE_COURSE_KERNEL, wrapper_body=THRICE)}), ""),
    "elapsed_time_halved": (
        Submission({"add": add_cell(prelude=ELAPSED_TIME_OVER.format(2), wrapper_body=THRICE)}),
        "disagree with its calls timed from outside its process"),
    "elapsed_time_over_ten": (
        Submission({"add": add_cell(prelude=ELAPSED_TIME_OVER.format(10), wrapper_body=THRICE)}),
        "faster than the hardware floor"),
    "forged_tier_a_timing": (
        Submission({"add": add_cell(prelude=FORGED_TIMING, wrapper_body=THRICE)}),
        "disagree with its calls timed from outside its process"),
    "skips_the_calls_timed_from_outside": (
        Submission({"add": add_cell(prelude=SKIPS_THE_CALLS_TIMED_FROM_OUTSIDE,
                                    wrapper_body=THRICE)}), "did they do the work?"),
}


# --------------------------------------------------------------------------------------------------
# Notebooks the grader refuses whole: no Jupyter writes them, or they are not the student's. Each is
# an edit of the handed-out lab's JSON (or a link); every function gets an error naming the cell (or
# the link), the lab keeps its full maximum, and the grader itself does not fail.


def _solution_cell(nb: dict) -> dict:
    return next(c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution"))


def _lone_surrogate(nb: dict) -> None:
    _solution_cell(nb)["source"] = ["x = '\ud800'\n"]


def _cell_is_a_string(nb: dict) -> None:
    nb["cells"].insert(0, "print('a cell')")


def _nbgrader_null(nb: dict) -> None:
    _solution_cell(nb)["metadata"]["nbgrader"] = None


def _source_of_ints(nb: dict) -> None:
    _solution_cell(nb)["source"] = [1, 2, 3]


MALFORMED = {  # name: (the edit, the phrase every function's message must hold)
    "lone_surrogate": (_lone_surrogate, "its source is not valid Unicode"),
    "cell_is_a_string": (_cell_is_a_string, "cell 1 is a str, not a cell"),
    "nbgrader_null": (_nbgrader_null, "its metadata (nbgrader's) is not an object"),
    "source_of_ints": (_source_of_ints, "its source is not text"),
}
# A notebook that is a link to the course's own solution.
LINKED = {"linked_to_the_solution": "it is a symbolic link"}
