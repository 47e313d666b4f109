"""The grader grades itself: the reference solution gets full marks, the untouched lab gets zero, and
every known-wrong submission in the corpus is caught with the reason a student can act on."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grading.notebooks import SOLUTIONS_DIR, LABS_DIR, grade_id
from kernels import runtime
from tests.grader_corpus import CORPUS

LAB = "01_elementwise_add_lab.ipynb"
CUPY_STATUS = "pass" if runtime.cupy_status()[0] else "needs a GPU"


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def write_submission(folder: Path, replace: dict[str, str] | None = None, edit_check: bool = False) -> Path:
    nb = nbformat.read(SOLUTIONS_DIR / LAB, as_version=4)
    for cell in nb.cells:
        if replace and grade_id(cell) in replace:
            cell.source = replace[grade_id(cell)]
        if edit_check and grade_id(cell) == "check_add":
            cell.source = "print('PASS')"
    folder.mkdir(parents=True)
    path = folder / LAB
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Grade every submission in one run of `python -m grading`, as an instructor would."""
    root = tmp_path_factory.mktemp("submissions")
    folders = {"solution": root / "solution", "lab": root / "lab", "edited_check": root / "edited_check"}
    write_submission(folders["solution"])
    folders["lab"].mkdir()
    (folders["lab"] / LAB).write_bytes((LABS_DIR / LAB).read_bytes())
    write_submission(folders["edited_check"], edit_check=True)
    for name, (cell, source, _) in CORPUS.items():
        folders[name] = root / name
        write_submission(folders[name], {cell: source})
    before = tree_hash(root)
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run([sys.executable, "-m", "grading", *map(str, folders.values()), "--out", str(out),
                           "--seed", "1234", "--timeout", "300", "--jobs", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    after = tree_hash(root)
    report = json.loads((out / "report.json").read_text())
    by_folder = {Path(lab["notebook"]).parent.name: lab for lab in report["labs"]}
    return {"report": report, "labs": by_folder, "unchanged": before == after, "out": out}


def functions(lab):
    return {f["name"]: f for f in lab["functions"]}


def test_solution_gets_full_marks(graded):
    lab = graded["labs"]["solution"]
    fs = functions(lab)
    assert fs["add"]["status"] == "pass" and fs["residual_add"]["status"] == "pass"
    assert fs["add_vectorized"]["status"] == CUPY_STATUS
    assert lab["score"]["points"] == lab["score"]["max_points"] > 0


def test_untouched_lab_gets_zero(graded):
    lab = graded["labs"]["lab"]
    assert lab["score"]["points"] == 0
    assert all(f["status"] in ("not implemented", "needs a GPU") for f in lab["functions"])


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_wrong_submission_is_caught_with_its_reason(graded, name):
    expectations = CORPUS[name][2]
    fs = functions(graded["labs"][name])
    for function, (status, phrase) in expectations.items():
        assert fs[function]["status"] == status, (function, fs[function]["message"])
        assert phrase in fs[function]["message"], fs[function]["message"]
    if any(status != "pass" for status, _ in expectations.values()):
        lab = graded["labs"][name]
        assert lab["score"]["points"] < lab["score"]["max_points"]


def test_edited_check_cell_is_reported_and_changes_nothing(graded):
    lab = graded["labs"]["edited_check"]
    assert "locked cell check_add was modified (the grader used the original)" in lab["notes"]
    assert lab["score"]["points"] == lab["score"]["max_points"]


def test_grader_never_writes_into_student_folders(graded):
    assert graded["unchanged"]


def test_markdown_report_lists_failures_with_worst_index(graded):
    text = (graded["out"] / "report.md").read_text()
    assert "| 01_elementwise_add |" in text and "worst index" in text and "first bad index" in text
    assert graded["report"]["fingerprint"]["torch"]


def test_timeout_costs_that_lab_only(tmp_path):
    hang = write_submission(tmp_path / "hang", {"add": "import time\ntime.sleep(600)\n"})
    ok = write_submission(tmp_path / "ok")
    proc = subprocess.run([sys.executable, "-m", "grading", str(hang.parent), str(ok.parent), "--out",
                           str(tmp_path / "report"), "--timeout", "20"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    labs = json.loads((tmp_path / "report" / "report.json").read_text())["labs"]
    assert "timed out after 20 s" in labs[0]["error"]
    assert labs[1]["score"]["points"] == labs[1]["score"]["max_points"] > 0
