"""Lab notebooks in nbgrader's cell format: roles of cells, generating labs, extracting solutions.

Every code cell of a lab that matters carries nbgrader metadata (schema 3):

* **solution** cells (`solution: true`): the student writes here. In `solutions/` they are complete,
with
  the parts to hide between `### BEGIN SOLUTION` and `### END SOLUTION`; in `labs/` those regions
  are replaced by a `raise NotImplementedError()` stub.
* **check** cells (`grade: true, locked: true`): call the grader's harness. The grader never runs
the
  student's copy: it uses the lab spec, and reports a check cell whose text was changed.
* **locked** cells (`locked: true`, not graded): read-only cells. Those whose grade_id starts with
  `setup` hold what the solution cells depend on (imports, constants); the grader takes them from
  the source notebook, not from the student's copy, and runs no other locked cell.

`solutions/` is the single source; `python -m grading.make_labs` writes `labs/` from it, with an
nbgrader checksum in every nbgrader cell (`grading.integrity`), as `nbgrader generate_assignment`
does.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

from grading.integrity import add_checksums, checksum_status

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


def read_notebook(path: Path) -> dict:
    """A notebook as plain JSON, each cell's source joined into one string.

    The grader reads notebooks this way instead of with nbformat, whose import (it validates with
    jsonschema) costs seconds in every worker process. A file that is not a notebook, or a cell
    that is not one as Jupyter writes it (a cell that is not an object, metadata that is not an
    object, a source that is not text, text that is not valid Unicode), raises ValueError naming
    the cell.
    """
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path} is not a Jupyter notebook (no list of cells)")
    for number, cell in enumerate(nb["cells"], 1):
        _check_cell(number, cell)
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        cell.setdefault("source", "")
        cell.setdefault("cell_type", "raw")
    return nb


def _check_cell(number: int, cell) -> None:
    where = f"cell {number}"
    if not isinstance(cell, dict):
        raise ValueError(f"{where} is a {type(cell).__name__}, not a cell")
    metadata = cell.get("metadata", {})
    if not isinstance(metadata, dict) or not isinstance(metadata.get("nbgrader", {}), dict):
        raise ValueError(f"{where}: its metadata (nbgrader's) is not an object")
    source = cell.get("source", "")
    parts = source if isinstance(source, list) else [source]
    if not all(isinstance(part, str) for part in parts):
        raise ValueError(f"{where}: its source is not text")
    if not isinstance(cell.get("cell_type", "raw"), str) or \
            not isinstance(metadata.get("nbgrader", {}).get("grade_id", ""), str):
        raise ValueError(f"{where}: its cell type or grade_id is not text")
    try:
        "".join(parts).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: its source is not valid Unicode ({exc.reason})") from None


def make_lab(solution_nb):
    """The student's lab: solution regions stubbed, outputs and run timestamps cleared, nbgrader
    checksums written."""
    lab = copy.deepcopy(solution_nb)
    for cell in lab.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop(
                "execution", None
            )  # when the solution was last run: not the student's
        if role(cell) == "solution":
            cell.source = stub_solution_regions(cell.source)
    add_checksums(lab)
    return lab


def lab_path_for(solution_path: Path) -> Path:
    return LABS_DIR / solution_path.name


def source_path_for(lab_notebook: Path, lab_id: str | None = None) -> Path:
    """The solution notebook a student's lab was generated from (by lab id, else by file name)."""
    return SOLUTIONS_DIR / (f"{lab_id}_lab.ipynb" if lab_id else lab_notebook.name)


def lab_id_of(path: Path, known=None) -> str:
    """The lab a notebook belongs to: its name without `_lab`; with `known` lab ids, also a renamed
    copy such as `01_elementwise_add_lab (1).ipynb` or `01_elementwise_add_lab-alice.ipynb`."""
    exact = re.sub(r"_lab$", "", path.stem)
    if known is None or exact in known:
        return exact
    matches = [lab for lab in known if path.stem.startswith(lab)]
    return max(matches, key=len) if matches else exact


def _code_lines(source: str) -> str:
    """A cell as Python. IPython's own transformer finds the magics and shell escapes where IPython
    would (a line that continues an expression, such as `% 2` inside parentheses, is Python) and
    turns them into calls of `get_ipython()`, which in a graded module runs none of them
    (`no_magics`). Without IPython, a line starting with % or ! is left out."""
    lines = source.splitlines()
    if not any(line.lstrip().startswith(("%", "!")) for line in lines):
        return "\n".join(lines)  # nothing IPython would change: every line keeps its number
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
    try:
        code = TransformerManager().transform_cell(source)
    except SyntaxError:  # left for Python to report, with its line
        return source
    # IPython drops the leading blank lines: put them back, so later lines keep their numbers
    blank = len(lines) - len("\n".join(lines).lstrip("\n").splitlines())
    return "\n" * blank + code.rstrip("\n")


class _NoMagics:
    """What `get_ipython()` is in a graded module: magics, shell escapes and cell magics do not
    run; the body of a cell magic that runs Python (%%time, %%capture, ...) does, as it does in
    the notebook."""

    def run_line_magic(self, name, line, *args, **kwargs):
        return None

    def run_cell_magic(self, name, line, cell):
        if name in ("time", "timeit", "capture", "prun"):
            caller = sys._getframe(1).f_globals
            exec(compile(cell, caller.get("__file__", "<cell>"), "exec"), caller)

    def system(self, command):
        return None

    getoutput = system


def no_magics() -> _NoMagics:
    """`get_ipython` of a graded module: put in its namespace before it runs."""
    return _NoMagics()


def locked_cell_status(student_nb, source_nb) -> list[dict]:
    """Per locked cell of the source: `ok`, `modified` or `deleted`, and whether the student's copy
    still matches the nbgrader checksum it carries (None: no checksum, e.g. a solution notebook)."""
    student_cells = {grade_id(c): c for c in student_nb["cells"] if grade_id(c)}
    status = []
    for cell in source_nb["cells"]:
        if cell["cell_type"] != "code" or role(cell) not in ("check", "locked"):
            continue
        gid = grade_id(cell)
        mine = student_cells.get(gid)
        if mine is None:
            status.append({"grade_id": gid, "status": "deleted", "checksum_ok": None})
            continue
        checksum_ok = checksum_status(mine)
        modified = (
            mine["source"] != cell["source"] or checksum_ok is False or role(mine) != role(cell)
        )
        status.append(
            {
                "grade_id": gid,
                "status": "modified" if modified else "ok",
                "checksum_ok": checksum_ok,
            }
        )
    return status


def solution_module(student_nb, source_nb) -> tuple[str, list[str]]:
    """(Python source of the graded module, notes about the student's notebook).

    Locked set-up cells come from the source; solution cells from the student (matched by grade_id);
    check cells, other locked cells and free cells are left out. The roles come from the source: a
    student cannot turn a locked cell into a solution cell by editing its metadata.
    """
    student_cells = {grade_id(c): c for c in student_nb["cells"] if grade_id(c)}
    notes, parts = [], []
    for cell in source_nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        kind, gid = role(cell), grade_id(cell)
        if kind == "locked" and gid.startswith("setup"):
            parts.append(strip_solution_markers(cell["source"]))
        elif kind == "solution":
            mine = student_cells.get(gid)
            if mine is None:
                notes.append(f"solution cell {gid} is missing from the notebook")
                continue
            if checksum_status(mine) is True:
                notes.append(f"solution cell {gid} is unchanged from the lab (not attempted)")
            parts.append(mine["source"])
    for entry in locked_cell_status(student_nb, source_nb):
        if entry["status"] == "deleted":
            notes.append(
                f"locked cell {entry['grade_id']} was deleted (the grader used the original)"
            )
        elif entry["status"] == "modified":
            why = " (its nbgrader checksum does not match)" if entry["checksum_ok"] is False else ""
            notes.append(
                f"locked cell {entry['grade_id']} was modified (the grader used the original){why}"
            )
    return "\n\n".join(_code_lines(p) for p in parts) + "\n", notes
