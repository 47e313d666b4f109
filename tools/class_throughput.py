"""Class-grading throughput on a one-node Slurm cluster in CPU mode: one shard, then N shards.

Each array task gets one CPU (`--cpus-per-task=1`, bound by Slurm's task/affinity plugin), the CPU
analogue of one GPU per shard. The target: N shards finish within 1.1 x (one shard's time / N) plus
the slowest student. Rounds alternate 1 and N shards so that load from elsewhere falls on both.

    python tools/class_throughput.py --students 8 --shards 2 --rounds 2 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grading import classroom  # noqa: E402
from kernels import runtime  # noqa: E402
from tests.slurm_cluster import SlurmCluster  # noqa: E402

LAB = "01_elementwise_add_lab.ipynb"


def make_class(folder: Path, students: int) -> Path:
    submissions = folder / "class"
    for i in range(students):
        student = submissions / f"student{i}"
        student.mkdir(parents=True)
        shutil.copy(REPO / "solutions" / LAB, student / LAB)
    return submissions


def grade_with_slurm(cluster: SlurmCluster, submissions: Path, out: Path, shards: int) -> dict:
    (out / "shards").mkdir(parents=True)
    script = subprocess.run(
        [
            sys.executable,
            "-m",
            "grading.classroom",
            "sbatch",
            "--submissions",
            str(submissions),
            "--out",
            str(out),
            "--shards",
            str(shards),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = out / "grade.sbatch"
    path.write_text(script)
    started = time.perf_counter()
    cluster.wait(cluster.submit(path), 1800)
    wall = time.perf_counter() - started
    reports = classroom.read_reports(out)
    per_student = {
        name: sum(lab.get("elapsed_s") or 0 for lab in report["labs"])
        for name, report in reports.items()
    }
    grades = {
        name: [lab["score"]["points"] for lab in report["labs"]] for name, report in reports.items()
    }
    return {
        "wall_s": round(wall, 2),
        "students": len(reports),
        "sum_lab_s": round(sum(per_student.values()), 2),
        "slowest_student_s": round(max(per_student.values()), 2),
        "grades": grades,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--students", type=int, default=8)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="class-throughput-"))
    submissions = make_class(folder, args.students)
    cluster = SlurmCluster(cpus=args.shards).start()
    runs: dict[int, list[dict]] = {1: [], args.shards: []}
    try:
        for round_ in range(args.rounds):
            for shards in (1, args.shards):
                run = grade_with_slurm(
                    cluster, submissions, folder / f"out-{round_}-{shards}", shards
                )
                runs[shards].append(run)
                print(f"round {round_}: {shards} shard(s) {run['wall_s']} s", flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
    one = statistics.median(r["wall_s"] for r in runs[1])
    many = statistics.median(r["wall_s"] for r in runs[args.shards])
    slowest = max(r["slowest_student_s"] for r in runs[args.shards])
    bound = 1.1 * one / args.shards + slowest
    grades_agree = all(r["grades"] == runs[1][0]["grades"] for rs in runs.values() for r in rs)
    result = {
        "what": f"{args.students} students x lab 01 (solution), CPU mode, one-node Slurm, "
        f"one CPU per shard (task/affinity)",
        "runs": {
            str(k): [{key: v for key, v in r.items() if key != "grades"} for r in rs]
            for k, rs in runs.items()
        },
        "median_wall_s": {"1": one, str(args.shards): many},
        "bound_s": round(bound, 2),
        "met": many <= bound,
        "speedup": round(one / many, 2),
        "grades_agree": grades_agree,
        "fingerprint": {
            **runtime.fingerprint(),
            "cores": os.cpu_count(),
            "script": "tools/class_throughput.py",
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k != "fingerprint"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
