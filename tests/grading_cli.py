"""Grading lab notebooks the way an instructor does, `python -m grading` in a subprocess, for the
tests of each lab's solution and untouched lab."""

import json
import shutil
import subprocess
import sys

from grading.notebooks import LABS_DIR, SOLUTIONS_DIR


def grade_solution_and_lab(tmp_path, name: str, *more_folders: str) -> dict[str, dict]:
    """The lab reports, by folder, of grading `name` from solutions/ (folder "solution") and from
    labs/ (folder "lab"), plus any `more_folders` the caller filled under tmp_path; fixed seed,
    two jobs, no timing."""
    for folder, source in (("solution", SOLUTIONS_DIR), ("lab", LABS_DIR)):
        (tmp_path / folder).mkdir()
        shutil.copy(source / name, tmp_path / folder / name)
    folders = [tmp_path / folder for folder in ("solution", "lab", *more_folders)]
    proc = subprocess.run(
        [sys.executable, "-m", "grading", *folders, "--out", tmp_path / "out",
         "--seed", "1234", "--jobs", "2", "--no-perf"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return {lab["notebook"].split("/")[-2]: lab for lab in report["labs"]}
