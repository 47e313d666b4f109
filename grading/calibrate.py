"""`python -m grading calibrate` (`make calibrate`): the expected rows of the GPU in hand.

    python -m grading calibrate [--lab LAB] [--out DIR]

grades the course's reference solutions (solutions/) on this GPU the way the course records its own
rows (`python -m grading solutions --write-expected`: every lab in its worker, the reference kernel
and PyTorch timed in the same run), then writes this GPU's row of each lab's expected table to
grading-reports/calibrated/<lab>.yaml (KERNELS_CALIBRATED_DIR moves it), outside the repository's
data. From then on the check cells, the grader's report and the benchmark page take that row first,
marked "measured on this machine". It takes as long as grading solutions/ (minutes per lab); run it
again after a change of driver or software. Without a GPU there is nothing to time: it says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from grading import expected
from grading.labs import get_lab
from kernels import runtime

SOLUTIONS_DIR = expected.ROOT / "solutions"
NEEDS_GPU = (
    "grading calibrate: times the course's kernels on this machine's GPU, and no CUDA GPU is "
    "visible here (CPU mode). Run it on the GPU you grade on; until then the reports use the "
    "course's measured or predicted rows (data/expected/)."
)


def write_rows(report: dict, source: Path) -> list[Path]:
    """This GPU's calibrated row for every lab of `report` (a grading of solutions/ on a GPU)
    that timed something."""
    fingerprint = report["fingerprint"]
    if fingerprint.get("mode") != "gpu":
        raise ValueError("a calibrated row needs a grading run on a GPU")
    written = []
    for lab in report["labs"]:
        if not expected.timed_anything(lab):
            continue
        written.append(
            expected.write(
                lab["lab"],
                get_lab(lab["lab"]).title,
                lab["functions"],
                fingerprint,
                source=str(source),
                folder=expected.CALIBRATED_DIR,
                status=expected.CALIBRATED,
            )
        )
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grading calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lab", help="calibrate only this lab id, e.g. 02_rmsnorm")
    parser.add_argument(
        "--out",
        type=Path,
        default=expected.CALIBRATED_DIR / "grading",
        help="where the grading run's report goes (default: beside the calibrated rows)",
    )
    args = parser.parse_args(argv)
    if not runtime.ON_GPU:
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "grading", str(SOLUTIONS_DIR), "--out", str(args.out)]
    # the audit lists a passed function's kernels for integrity, which a reference solution needs
    # not prove: skipping it keeps the run to the timing
    command += ["--no-kernel-audit"] + (["--lab", args.lab] if args.lab else [])
    status = subprocess.run(command).returncode
    report_path = args.out / "report.json"
    if status != 0 or not report_path.exists():
        print(f"grading calibrate: grading solutions/ failed (exit {status})", file=sys.stderr)
        return status or 1
    written = write_rows(json.loads(report_path.read_text()), report_path)
    for path in written:
        print(f"wrote {path} (measured on this machine)")
    if not written:
        print("grading calibrate: nothing was timed, no row written", file=sys.stderr)
        return 1
    return 0
