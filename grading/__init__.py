"""The course's grader. In a notebook: `grading.check("01_elementwise_add", "add", add)`;
from a shell: `python -m grading` (see grading/cli.py and grading/README.md).

The notebook check cells print the grader's own result (`grading.harness.check_function`, the data
behind the JSON and Markdown reports) as compact colour-coded tables: one row per dtype and one
column per shape for correctness, then one row per configuration for performance (GPU only).
"""

from __future__ import annotations

import re

from kernels import bench, runtime

GREEN, RED, YELLOW, RESET = "\033[32m", "\033[31m", "\033[33m", "\033[0m"
TIER_COLOUR = {"A": GREEN, "B": GREEN, "C": YELLOW, "D": YELLOW, "F": RED}
MAX_FAILURES_SHOWN = 4
_ANSI = re.compile(r"\033\[[0-9;]*m")


def _paint(colour: str, text: str) -> str:
    return f"{colour}{text}{RESET}"


def _width(text: str) -> int:
    return len(_ANSI.sub("", text))


def _table(
    header: list[str], rows: list[list[str]], indent: str = "  ", left: tuple[int, ...] = (0,)
) -> list[str]:
    """Columns in `left` left-aligned, the others right-aligned; widths ignore colour codes."""
    widths = [max(_width(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = {i % len(header) for i in left}

    def line(cells):
        parts = [
            c + " " * (w - _width(c)) if i in left else " " * (w - _width(c)) + c
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return (indent + "  ".join(parts)).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _status_line(result) -> str:
    colour = {"pass": GREEN, "not implemented": YELLOW, "needs a GPU": YELLOW}.get(
        result.status, RED
    )
    points = f"{result.points}/{result.max_points} points"
    head = f"{colour}{result.status.upper()}{RESET}  {result.name}: {points}"
    return head + (f" -- {result.message}" if result.message else "")


def _column(case) -> str:
    size = "x".join(map(str, case.shape)) or "scalar"
    return size if case.layout == "contiguous" else f"{size} {case.layout}"


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def correctness_lines(spec, result) -> list[str]:
    """The correctness cases of `result` (a FunctionResult) as a dtype x shape table, then each
    failure with the error figures of the grader's report."""
    if not result.cases:
        return []
    by_label = {c.case: c for c in result.cases}
    cases = spec.cases if result.seed is None else spec.cases_for(result.seed)
    columns = list(dict.fromkeys(_column(case) for case in cases))
    dtypes = list(dict.fromkeys(case.dtype for case in cases))
    grid = {(_dtype(case.dtype), _column(case)): by_label.get(case.label) for case in cases}
    rows = []
    for dtype in map(_dtype, dtypes):
        row = [dtype]
        for col in columns:
            res = grid.get((dtype, col))
            row.append(
                "-" if res is None else _paint(GREEN, "PASS") if res.ok else _paint(RED, "FAIL")
            )
        rows.append(row)
    lines = _table([f"{result.name}: n", *columns], rows)
    failures = [c for c in result.cases if not c.ok]
    for c in failures[:MAX_FAILURES_SHOWN]:
        cmp = c.comparison or {}
        figures = (
            ""
            if cmp.get("max_abs_err") is None
            else f" [max abs err {_fmt(cmp['max_abs_err'], '.3g')}, "
            f"max rel err {_fmt(cmp.get('max_rel_err'), '.3g')}]"
        )
        lines.append(f"  {_paint(RED, 'FAIL')}  {c.case}: {c.reason}{figures}")
    if len(failures) > MAX_FAILURES_SHOWN:
        lines.append(f"  ... and {len(failures) - MAX_FAILURES_SHOWN} more failing cases")
    return lines


def performance_lines(result) -> list[str]:
    """The performance configurations of `result`, with the columns of the grader's report."""
    slug = runtime.gpu_info().slug if runtime.gpu_info() else "this GPU"
    rows, notes = [], False
    for p in result.perf:
        exp = p.expected
        spread = "-" if not p.spread_us else f"{p.spread_us[0]:.1f}-{p.spread_us[1]:.1f}"
        tier = p.tier or "-"
        rows.append(
            [
                p.config,
                _fmt(p.student_us, ".2f"),
                spread,
                _fmt(p.reference_us, ".2f"),
                _fmt(p.torch_us, ".2f"),
                _fmt(p.ratio_to_reference, ".2f") + "x",
                _fmt(p.gbps, ".0f"),
                _fmt(p.percent_of_floor, ".0f"),
                _paint(TIER_COLOUR.get(tier, RESET), tier),
                f"{exp['reference_us']:.2f} ({exp['status']})" if exp else "no row",
                p.note,
            ]
        )
        notes = notes or bool(p.note)
    header = [
        "config",
        "yours us",
        "p10-p90",
        "reference us",
        "torch us",
        "vs reference",
        "GB/s",
        "% floor",
        "tier",
        f"expected ref us ({slug})",
        "note",
    ]
    if not notes:
        header, rows = header[:-1], [r[:-1] for r in rows]
    return _table(header, rows, indent="", left=(0, -1) if notes else (0,))


# The seed of a notebook's check cells: the same drawn sizes and inputs on every run, so a check
# cell's output is one the notebook can commit; `python -m grading` draws from a secret seed.
NOTEBOOK_SEED = 20261125


def check(lab_id: str, name: str, fn, *, seed: int | None = None) -> None:
    """Run the grader's correctness checks for one function and print them (as the grader will),
    with the cases drawn for `seed` (default: NOTEBOOK_SEED)."""
    from grading.harness import check_function
    from grading.labs import get_lab

    lab = get_lab(lab_id)
    if lab.function(name).grade_group is not None:
        raise ValueError(f"{name} runs in a process group of several ranks: use the check cell "
                         f"of lab {lab_id}, which starts the ranks")
    seed = NOTEBOOK_SEED if seed is None else seed
    result = check_function(lab, name, fn, seed=seed, perf=False)
    for line in correctness_lines(lab.function(name), result):
        print(line)
    print(_status_line(result))
    source = getattr(fn, "__globals__", {}).get(f"{name}_source")
    if result.status == "needs a GPU" and not runtime.ON_GPU and callable(source):
        _compile_without_a_gpu(name, source)


def _compile_without_a_gpu(name: str, source) -> None:
    """CPU mode: the lab's CUDA C (its `<name>_source()`) compiled by nvcc, never run."""
    from kernels import nvcc_report

    try:
        code = source()
    except NotImplementedError:
        print(f"{name}: {name}_source() is not written yet: nothing to compile")
        return
    except Exception as exc:  # noqa: BLE001 - a student's function may raise anything
        print(f"{name}: {name}_source() raised {type(exc).__name__}: {exc}")
        return
    print(nvcc_report.feedback(name, code))


def check_performance(lab_id: str, name: str, fn, *, seed: int | None = None) -> None:
    """Time one function against the course's kernel and PyTorch, and print it against the
    expected table."""
    from grading.harness import check_function
    from grading.labs import get_lab

    if not runtime.ON_GPU:
        print(f"{name}: performance {bench.NOT_MEASURED}")
        return
    result = check_function(get_lab(lab_id), name, fn, seed=seed, perf=True)
    if result.status != "pass":
        print(_status_line(result))
        return
    print("\n".join(performance_lines(result)))
