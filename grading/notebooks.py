"""Lab notebooks in nbgrader's cell format: roles of cells, generating labs, extracting solutions.

Every code cell of a lab that matters carries nbgrader metadata (schema 3):

* **solution** cells (`solution: true`): the student writes here. In `solutions/` they are complete, with
  the parts to hide between `### BEGIN SOLUTION` and `### END SOLUTION`; in `labs/` those regions are
  replaced by a `raise NotImplementedError()` stub.
* **check** cells (`grade: true, locked: true`): call the grader's harness. The grader never runs the
  student's copy: it uses the lab spec, and reports a check cell whose text was changed.
* **locked** cells (`locked: true`, not graded): read-only cells. Those whose grade_id starts with
  `setup` hold what the solution cells depend on (imports, constants); the grader takes them from the
  source notebook, not from the student's copy, and runs no other locked cell.

`solutions/` is the single source; `python -m grading.make_labs` writes `labs/` from it.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
REPO = Path(__file__).resolve().parents[1]
SOLUTIONS_DIR, LABS_DIR = REPO / "solutions", REPO / "labs"


def role(cell) -> str:
    """'solution', 'check', 'locked' or 'free' (a cell without nbgrader metadata)."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    if meta.get("solution"):
        return "solution"
    if meta.get("grade") and meta.get("locked"):
        return "check"
    if meta.get("locked"):
        return "locked"
    return "free"


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def stub_solution_regions(source: str) -> str:
    """Replace each BEGIN/END SOLUTION region by the stub, at the region's indentation."""
    out, inside = [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += [indent + s for s in STUB]
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN} without {END}")
    return "\n".join(out)


def strip_solution_markers(source: str) -> str:
    """The complete code, without the BEGIN/END marker lines (what the solution notebook runs)."""
    return "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN, END))


def make_lab(solution_nb) -> nbformat.NotebookNode:
    """The student's lab: solution regions stubbed, outputs cleared."""
    lab = copy.deepcopy(solution_nb)
    for cell in lab.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if role(cell) == "solution":
            cell.source = stub_solution_regions(cell.source)
    return lab


def lab_path_for(solution_path: Path) -> Path:
    return LABS_DIR / solution_path.name


def source_path_for(lab_notebook: Path) -> Path:
    """The solution notebook a student's lab was generated from (by file name)."""
    return SOLUTIONS_DIR / lab_notebook.name


def lab_id_of(path: Path) -> str:
    return re.sub(r"_lab$", "", path.stem)


def _code_lines(source: str) -> str:
    # IPython magics and shell escapes are not Python; the grader's module has no use for them.
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def solution_module(student_nb, source_nb) -> tuple[str, list[str]]:
    """(Python source of the graded module, notes about the student's notebook).

    Locked set-up cells come from the source; solution cells from the student (matched by grade_id);
    check cells, other locked cells and free cells are left out.
    """
    student_cells = {grade_id(c): c for c in student_nb.cells if grade_id(c)}
    notes, parts = [], []
    for cell in source_nb.cells:
        if cell.cell_type != "code":
            continue
        kind, gid = role(cell), grade_id(cell)
        if kind == "locked" and gid.startswith("setup"):
            parts.append(strip_solution_markers(cell.source))
        elif kind == "solution":
            mine = student_cells.get(gid)
            if mine is None:
                notes.append(f"solution cell {gid} is missing from the notebook")
                continue
            parts.append(mine.source)
        if kind in ("check", "locked"):
            mine = student_cells.get(gid)
            if mine is None:
                notes.append(f"locked cell {gid} was deleted (the grader used the original)")
            elif mine.source != cell.source:
                notes.append(f"locked cell {gid} was modified (the grader used the original)")
    return "\n\n".join(_code_lines(p) for p in parts) + "\n", notes
