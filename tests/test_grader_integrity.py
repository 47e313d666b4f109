"""What the grader trusts: nbgrader checksums in the generated labs, locked cells taken from the
source, the grader's own functions, and the content hashes that let an instructor's run resume."""

import hashlib
import json

import nbformat
import pytest

from grading import integrity
from grading.integrity import (
    GraderGuard,
    checksum_status,
    compute_checksum,
    content_hash,
    grader_version,
)
from grading.notebooks import (
    LABS_DIR,
    SOLUTIONS_DIR,
    grade_id,
    locked_cell_status,
    read_notebook,
    solution_module,
)

LABS = sorted(LABS_DIR.glob("*_lab.ipynb"))


def test_checksum_is_nbgraders():
    """nbgrader.utils.compute_checksum: md5 of source, cell type, grade/solution/locked flags,
    grade_id, then the points of a grade cell."""
    cell = {
        "cell_type": "code",
        "source": "grading.check(LAB, 'add', add)",
        "metadata": {
            "nbgrader": {
                "grade": True,
                "solution": False,
                "locked": True,
                "grade_id": "check_add",
                "points": 3,
            }
        },
    }
    expected = hashlib.md5(
        b"grading.check(LAB, 'add', add)"
        + b"code"
        + b"True"
        + b"False"
        + b"True"
        + b"check_add"
        + b"3.0"
    ).hexdigest()
    assert compute_checksum(cell) == expected
    solution = {
        "cell_type": "code",
        "source": "x = 1",
        "metadata": {
            "nbgrader": {"grade": False, "solution": True, "locked": True, "grade_id": "add"}
        },
    }  # solution cells are never locked
    assert compute_checksum(solution) == hashlib.md5(b"x = 1codeFalseTrueFalseadd").hexdigest()


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.name)
def test_generated_labs_carry_valid_checksums(path):
    nb = read_notebook(path)
    graded = [c for c in nb["cells"] if "nbgrader" in c.get("metadata", {})]
    assert graded
    for cell in graded:
        assert checksum_status(cell) is True, grade_id(cell)


def _lab():
    return read_notebook(LABS_DIR / "01_elementwise_add_lab.ipynb")


def test_edited_deleted_and_retyped_locked_cells_are_reported():
    source = read_notebook(SOLUTIONS_DIR / "01_elementwise_add_lab.ipynb")
    student = _lab()
    cells = {grade_id(c): c for c in student["cells"] if grade_id(c)}
    cells["check_add"]["source"] = "print('PASS')"
    # Turning a check cell into a solution cell (and fixing its checksum) must not make it run.
    cells["check_residual_add"]["metadata"]["nbgrader"].update(
        solution=True, grade=False, locked=False
    )
    cells["check_residual_add"]["metadata"]["nbgrader"]["checksum"] = compute_checksum(
        cells["check_residual_add"]
    )
    student["cells"] = [c for c in student["cells"] if grade_id(c) != "check_add_vectorized"]
    status = {s["grade_id"]: s for s in locked_cell_status(student, source)}
    assert status["check_add"] == {
        "grade_id": "check_add",
        "status": "modified",
        "checksum_ok": False,
    }
    assert status["check_residual_add"]["status"] == "modified"
    assert status["check_add_vectorized"]["status"] == "deleted"
    assert status["setup"] == {"grade_id": "setup", "status": "ok", "checksum_ok": True}
    code, notes = solution_module(student, source)
    assert "grading.check(" not in code and "print('PASS')" not in code
    assert (
        "locked cell check_add was modified (the grader used the original) (its nbgrader checksum "
        "does not "
        "match)" in notes
    )
    assert "locked cell check_add_vectorized was deleted (the grader used the original)" in notes


def test_untouched_solution_cells_are_noted_as_not_attempted():
    code, notes = solution_module(
        _lab(), read_notebook(SOLUTIONS_DIR / "01_elementwise_add_lab.ipynb")
    )
    assert "solution cell add is unchanged from the lab (not attempted)" in notes
    assert "raise NotImplementedError()" in code


def test_read_notebook_joins_sources_and_rejects_non_notebooks(tmp_path):
    nb = nbformat.read(LABS_DIR / "01_elementwise_add_lab.ipynb", as_version=4)
    path = tmp_path / "x.ipynb"
    nbformat.write(nb, path)  # nbformat writes sources as lists of lines
    assert isinstance(json.loads(path.read_text())["cells"][1]["source"], list)
    assert [c["source"] for c in read_notebook(path)["cells"]] == [c.source for c in nb.cells]
    path.write_text('{"not": "a notebook"}')
    with pytest.raises(ValueError):
        read_notebook(path)


def test_guard_notices_a_replaced_grader_function():
    import kernels.testing

    guard = GraderGuard()
    original = kernels.testing.compare
    try:
        kernels.testing.compare = lambda *a, **k: None
        assert guard.changed() == ["kernels.testing.compare"]
    finally:
        kernels.testing.compare = original
    assert guard.changed() == []


def test_content_hash_follows_the_notebook_and_the_options(tmp_path):
    nb = tmp_path / "lab.ipynb"
    nb.write_text("{}")
    source = SOLUTIONS_DIR / "01_elementwise_add_lab.ipynb"
    first = content_hash(nb, source, {"cpu": False})
    assert first == content_hash(nb, source, {"cpu": False})
    assert first != content_hash(nb, source, {"cpu": True})
    nb.write_text('{"changed": 1}')
    assert first != content_hash(nb, source, {"cpu": False})
    assert len(grader_version()) == 16 and grader_version() == integrity.grader_version()
