"""The course's grader. In a notebook: `grading.check("01_elementwise_add", "add", add)`;
from a shell: `python -m grading` (see grading/cli.py and grading/README.md)."""
from __future__ import annotations

from kernels import bench, runtime

GREEN, RED, YELLOW, RESET = "\033[32m", "\033[31m", "\033[33m", "\033[0m"


def _status_line(result) -> str:
    colour = {"pass": GREEN, "not implemented": YELLOW, "needs a GPU": YELLOW}.get(result.status, RED)
    head = f"{colour}{result.status.upper()}{RESET}  {result.name}: {result.points}/{result.max_points} points"
    return head + (f" -- {result.message}" if result.message else "")


def check(lab_id: str, name: str, fn, *, seed: int | None = None) -> None:
    """Run the grader's correctness checks for one function and print them (what the grader will say)."""
    from grading.harness import check_function
    from grading.labs import get_lab

    result = check_function(get_lab(lab_id), name, fn, seed=seed, perf=False)
    for case in result.cases:
        mark = f"{GREEN}PASS{RESET}" if case.ok else f"{RED}FAIL{RESET}"
        print(f"  {mark}  {case.case}" + ("" if case.ok or not case.reason else f": {case.reason}"))
    print(_status_line(result))


def check_performance(lab_id: str, name: str, fn, *, seed: int | None = None) -> None:
    """Time one function against the course's kernel and PyTorch, and print it against the expected table."""
    from grading.harness import check_function
    from grading.labs import get_lab

    if not runtime.ON_GPU:
        print(f"{name}: performance {bench.NOT_MEASURED}")
        return
    result = check_function(get_lab(lab_id), name, fn, seed=seed, perf=True)
    if result.status != "pass":
        print(_status_line(result))
        return
    rows = []
    for p in result.perf:
        exp = p.expected
        rows.append({"config": p.config, "yours us": p.student_us, "reference us": p.reference_us,
                     "torch us": p.torch_us, "vs reference": p.ratio_to_reference, "GB/s": p.gbps,
                     "% floor": p.percent_of_floor, "tier": p.tier,
                     f"expected ref ({runtime.gpu_info().slug})": exp["reference_us"] if exp else None})
    print(bench.table(rows, floatfmt=".2f"))
