"""The mistakes every lab's corpus must have, built once for labs 02-06 from each lab's
solution.

Lab 01's corpus (tests/grader_corpus_lab01.py) spells each mistake out for its `add`; here a mistake
is a rewrite of one graded function's wrapper region (`SolutionCells.solve_with`), written in terms
of that wrapper's names (`Target`), so one definition covers every lab. Each `mistake(target, name)`
is a `Submission` of tests/grader_corpus_lab01.py: the rewritten solution cell, the status and
phrase the grader must give on a GPU (`expect`), what the interpreter shows where it differs (`cpu`,
with `gpu_only` saying why), and the notes it must write.

Two kinds: `IN_PROCESS` mistakes are graded with `check_function` directly (fast, no subprocess);
`PROCESS_LEVEL` ones hang, exhaust memory or crash the process, so only the runner's watched worker
can grade them (tests/test_grader_generic.py grades them with `python -m grading --submissions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grading.labs import get_lab
from grading.notebooks import LABS_DIR, SOLUTIONS_DIR, grade_id, read_notebook
from tests.grader_corpus_lab01 import PASS, SolutionCells, Submission


@dataclass(frozen=True)
class Target:
    """One graded function of a lab, and the names its wrapper uses around its solution region."""

    lab: str  # lab id, e.g. "02_rmsnorm"
    function: str  # the graded function, also the grade_id of its solution cell
    first_input: str  # the wrapper's first tensor argument: the one returned, mutated or rounded
    outputs: tuple[str, ...]  # the wrapper's output tensors, in the order it returns them
    calls_reference: (
        str  # the region computing with the lab's PyTorch reference instead of a kernel
    )
    reference_phrase: str  # how the grader names that reference
    float32_ulp_allowed: (
        int  # the spec's tolerance, as the grader's lower-precision diagnosis states it
    )

    @property
    def notebook(self) -> str:
        return f"{self.lab}_lab.ipynb"

    @property
    def solution(self) -> SolutionCells:
        return _solution_cells(self.notebook)

    @property
    def first_case(self) -> str:
        """The label of the spec's first case: where a mistake that fails every call is reported."""
        return get_lab(self.lab).function(self.function).cases[0].label

    @property
    def out_name(self) -> str:
        """How the grader names the first output in messages ("out", or "out (ids)" for several)."""
        return "out" if len(self.outputs) == 1 else f"out ({self.outputs[0]})"

    def returning(self, first: str) -> str:
        """A return statement with `first` in place of the first output."""
        return "return " + ", ".join((first, *self.outputs[1:]))


_CELLS: dict[str, SolutionCells] = {}


def _solution_cells(notebook: str) -> SolutionCells:
    if notebook not in _CELLS:
        _CELLS[notebook] = SolutionCells(SOLUTIONS_DIR / notebook)
    return _CELLS[notebook]


# What each lab's reference is called in the grader's message is pinned up to "(aten.": the aten op
# behind F.rms_norm or F.scaled_dot_product_attention differs between the CPU and CUDA builds.
# Rounded to bfloat16, each target's first float32 output is caught (attention's: its float32 lse,
# allowed one ulp of float16, 8192 of float32; the router's top-1 weights are exactly 1 whatever the
# logits: its first top-2 case).
TARGETS = {
    t.lab: t
    for t in (
        Target(
            "02_rmsnorm",
            "rms_norm",
            "x",
            ("out",),
            "out.copy_(torch.nn.functional.rms_norm(x, w.shape, w, eps))",
            "torch.nn.functional.rms_norm (aten.",
            129,
        ),
        Target(
            "03_flash_attention",
            "flash_attention",
            "q",
            ("out", "lse"),
            "out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, "
            "is_causal=causal,\n"
            "                                                           enable_gqa=n_heads != "
            "k.shape[1]))",
            "torch.nn.functional.scaled_dot_product_attention (aten.",
            8192,
        ),
        Target(
            "04_mixed_precision",
            "kahan_sum",
            "x",
            ("out",),
            "torch.sum(x, dim=1, out=out)",
            "torch.sum (aten.sum.IntList_out)",
            2,
        ),
        Target(
            "05_memory_profiling",
            "token_losses",
            "x",
            ("out",),
            "logits = x.float() @ w.float().T\n"
            "out.copy_(torch.nn.functional.cross_entropy(logits, targets, "
            "ignore_index=ignore_index, "
            "reduction='none'))",
            "Tensor.matmul (aten.mm.default), torch.nn.functional.cross_entropy (aten.",
            33,
        ),
        # the renormalized top-k weights are the softmax of the top-k logits: topk first,
        # then softmax (lab 06's
        # own corpus calls softmax first)
        Target(
            "06_moe",
            "route_topk",
            "logits",
            ("ids", "weights"),
            "top_logits, top = torch.topk(logits.float(), top_k, dim=1)\n"
            "ids.copy_(top)\nweights.copy_(torch.softmax(top_logits, dim=1))",
            "torch.topk (aten.topk.default)",
            16,
        ),
    )
}

# Work on a side stream, without the two waits a correct program has. In CPU mode there are no
# streams (torch.cuda.stream(None) does nothing): the same code is the solution there, and passes.
SIDE_STREAM = """side = torch.cuda.Stream() if runtime.ON_GPU else None
with torch.cuda.stream(side):
{correct}"""
# Correct the first time, then the first result for the same shapes, whatever the values.
CACHE = """key = tuple((tuple(o.shape), o.dtype) for o in ({outputs},))
if key in _PREVIOUS:
    for mine, kept in zip(({outputs},), _PREVIOUS[key]):
        mine.copy_(kept)
else:
{correct}
    _PREVIOUS[key] = tuple(o.clone() for o in ({outputs},))"""
# Stores 2**45 elements past the first output: an unmapped address on any machine.
WILD_STORE_KERNEL = """@triton.jit
def wild_store_kernel(ptr):
    tl.store(ptr + (1 << 45), tl.load(ptr))


"""


def _indented(code: str) -> str:
    return "\n".join("    " + line for line in code.splitlines())


def _fails(target: Target, phrase: str) -> dict[str, tuple[str, str]]:
    return {target.function: ("fail", phrase)}


def mistake(target: Target, name: str) -> Submission:
    """The solution with the mistake `name` in `target`'s wrapper, and what the grader must say."""
    fn, correct, outputs = (
        target.function,
        target.solution.region(target.function),
        ", ".join(target.outputs),
    )

    def solved(code: str, prelude: str = "") -> dict[str, str]:
        return target.solution.solve_with(fn, code, prelude)

    if name == "returns_an_input":
        return Submission(
            solved(target.returning(target.first_input)),
            _fails(
                target,
                f"given out=, it must write into {target.out_name} and return it (it returned its "
                "input "
                f"{target.first_input})",
            ),
        )
    if name == "returns_torch_empty":
        return Submission(
            solved(target.returning(f"torch.empty_like({target.outputs[0]})")),
            _fails(
                target,
                f"given out=, it must write into {target.out_name} and return it (it returned "
                "another tensor)",
            ),
        )
    if name == "calls_the_reference":
        return Submission(
            solved(target.calls_reference),
            _fails(
                target,
                "computes with PyTorch instead of its own kernel: " + target.reference_phrase,
            ),
        )
    if name == "caches_outputs":
        return Submission(
            solved(CACHE.format(outputs=outputs, correct=_indented(correct)), "_PREVIOUS = {}\n\n"),
            _fails(
                target,
                "returned the previous call's result for new inputs: does it cache outputs "
                "between calls?",
            ),
        )
    if name == "mutates_an_input":  # "done with it": the input cleared after the kernel
        return Submission(
            solved(f"{correct}\n{target.first_input}.zero_()"),
            _fails(
                target,
                f"modified its input {target.first_input} (inputs must be left as they were)",
            ),
        )
    if (
        name == "lower_precision"
    ):  # the input rounded to bfloat16 first: 8 significant bits where float32 has 24
        first = target.first_input
        return Submission(
            solved(f"{first} = {first}.to(torch.bfloat16).to({first}.dtype)\n{correct}"),
            _fails(
                target,
                f"ulp of float32 where {target.float32_ulp_allowed} is allowed: is it "
                f"computed in a lower precision?",
            ),
        )
    if name == "side_stream_unsynced":
        return Submission(
            solved(SIDE_STREAM.format(correct=_indented(correct))),
            _fails(
                target,
                "the output was not ready on PyTorch's current stream when the function returned",
            ),
            cpu={fn: PASS},
            gpu_only="the interpreter has no streams: the same code is correct on a CPU",
        )
    if name == "raises":
        return Submission(
            solved('raise RuntimeError("boom")'),
            _fails(target, f"RuntimeError: boom (at {fn}, line"),
        )
    # ---- process level: graded through the runner, in a worker it must stop or restart
    case = target.first_case
    if name == "infinite_loop":
        return Submission(
            solved("while True:\n    pass"), {fn: ("error", f"case {case}: did not finish within")}
        )
    if (
        name == "allocates_until_oom"
    ):  # 256 MiB at a time, never touched: it reaches the cap in milliseconds
        return Submission(
            solved(
                f"hog = []\nwhile True:\n    hog.append(torch.empty(1 << 28, dtype=torch.uint8, "
                f"device={target.first_input}.device))"
            ),
            _fails(target, f"{case}: ran out of GPU memory"),
            cpu=_fails(target, f"{case}: ran out of host memory"),
            gpu_only="on the CPU the tensors are host memory: the host cap (RLIMIT_AS) stops it",
        )
    if name == "illegal_memory_access":
        return Submission(
            solved(f"wild_store_kernel[(1,)]({target.outputs[0]})\n{correct}", WILD_STORE_KERNEL),
            {
                fn: (
                    "error",
                    f"case {case}: CUDA error: an illegal memory access was encountered (an "
                    "out-of-bounds "
                    f"read or write?)",
                )
            },
            cpu={
                fn: (
                    "error",
                    f"case {case}: the grading process crashed with SIGSEGV: an out-of-bounds "
                    "memory "
                    f"access?",
                )
            },
            gpu_only="the interpreter has no CUDA context: the store crashes the process "
                     "(SIGSEGV) instead",
        )
    if (
        name == "edits_check_cell"
    ):  # the check cell made to print PASS: restored from the source, and reported
        return Submission(
            {fn: target.solution.cells[fn], f"check_{fn}": "print('PASS')"},
            {fn: PASS},
            notes=(
                f"locked cell check_{fn} was modified (the grader used the original) (its "
                "nbgrader checksum does not "
                f"match)",
            ),
        )
    raise KeyError(name)


IN_PROCESS = (
    "returns_an_input",
    "returns_torch_empty",
    "calls_the_reference",
    "caches_outputs",
    "mutates_an_input",
    "lower_precision",
    "side_stream_unsynced",
    "raises",
)
PROCESS_LEVEL = (
    "infinite_loop",
    "allocates_until_oom",
    "illegal_memory_access",
    "edits_check_cell",
)


# --------------------------------------------------------------------------------------------------
# Submissions as the grader sees them


def graded_module(target: Target, cells: dict[str, str], folder: Path):
    """The module the worker would build from the solution notebook with `cells` replaced,
    imported."""
    return target.solution.module(cells, folder)


def lab_notebook_with(target: Target, cells: dict[str, str]) -> dict:
    """What a student who attempted only `target` hands in: the lab as handed out (its other
    functions still stubs, graded "not implemented" in no time), with `cells` replaced."""
    notebook = read_notebook(LABS_DIR / target.notebook)
    for cell in notebook["cells"]:
        cell["source"] = cells.get(grade_id(cell), cell["source"])
    return notebook
