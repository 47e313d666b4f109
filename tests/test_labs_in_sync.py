"""labs/ is generated from solutions/, and both carry valid nbgrader metadata."""

import subprocess
import sys

import nbformat
import pytest

from grading.notebooks import (
    BEGIN,
    END,
    LABS_DIR,
    SOLUTIONS_DIR,
    make_lab,
    role,
    stub_solution_regions,
)

SOLUTIONS = sorted(SOLUTIONS_DIR.glob("*_lab.ipynb"))


def test_labs_equal_what_the_generator_makes():
    proc = subprocess.run(
        [sys.executable, "-m", "grading.make_labs", "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in LABS_DIR.glob("*.ipynb")} == {p.name for p in SOLUTIONS}


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_nbgrader_metadata(path):
    nb = nbformat.read(path, as_version=4)
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), "grade_ids must be unique"
    roles = [role(c) for c in nb.cells]
    assert "solution" in roles and "check" in roles
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if not meta:
            continue
        assert meta["schema_version"] == 3
        if role(cell) == "check":
            assert meta["points"] > 0 and meta["locked"] and not meta["solution"]
        if role(cell) == "solution":
            assert BEGIN in cell.source and END in cell.source


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_lab_hides_every_solution_region(path):
    solution = nbformat.read(path, as_version=4)
    lab = make_lab(solution)
    for s_cell, l_cell in zip(solution.cells, lab.cells):
        if role(s_cell) == "solution":
            assert BEGIN not in l_cell.source and "raise NotImplementedError()" in l_cell.source
            hidden = s_cell.source.split(BEGIN)[1].split(END)[0].strip().splitlines()[0]
            assert hidden.strip() not in l_cell.source
        else:
            assert s_cell.source == l_cell.source
        if l_cell.cell_type == "code":
            assert l_cell.outputs == []


def test_stub_keeps_indentation_and_rejects_unbalanced_markers():
    src = f"def f():\n    x = 1\n    {BEGIN}\n    return 2\n    {END}\n"
    assert (
        stub_solution_regions(src)
        == "def f():\n    x = 1\n    # YOUR CODE HERE\n    raise NotImplementedError()"
    )
    with pytest.raises(ValueError):
        stub_solution_regions(f"{BEGIN}\nx = 1\n")
    with pytest.raises(ValueError):
        stub_solution_regions(f"x = 1\n{END}\n")
