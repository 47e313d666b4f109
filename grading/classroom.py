"""Grading a whole class: shards over GPUs and nodes, one merged summary, progress at a glance.

    python -m grading --submissions DIR --out OUT --shard K/N     grade shard K of N (0 <= K < N)
    python -m grading --submissions DIR --out OUT --gpus 0,1,2,3  one shard per GPU of this node
    python -m grading.classroom merge --submissions DIR --out OUT
    python -m grading.classroom sbatch --submissions DIR --out OUT --shards N [--gpu] > grade.sbatch

Every shard writes per-student reports into the same OUT/students/<student>/ (atomic writes, one
folder per student, so shards never touch each other's files) and its own OUT/shards/K-of-N.json.
`merge` rebuilds OUT/summary.{json,csv,md,png} from whatever per-student reports exist, and says
which students are missing, which are partial, and which were graded on another GPU model or
software stack than the rest. Re-running a shard regrades only what is missing or changed (the
per-lab content hash, as in any --submissions run).

Which shard a student belongs to: students are ordered by a hash of their folder name and cut into
N runs of about equal numbers of labs. The order does not depend on who else is in the class, so a
student who joins moves at most the students at the N - 1 cut points to a neighbouring shard.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from grading import report as report_mod
from grading.integrity import grader_version
from grading.shards import assign_shards, now, student_notebooks, write_atomically

# Per-lab time limit of a --submissions run (cli's --timeout default), and what a Slurm task adds
# for starting Python and CUDA before its first lab.
LAB_TIMEOUT_S = 900
TASK_OVERHEAD_S = 300
# The software that decides what a timing means: a report made with other versions is flagged.
STACK_KEYS = ("gpu", "torch", "triton", "cupy", "cuda")


def grade_on_gpus(args) -> int:
    """`python -m grading --submissions DIR --gpus 0,1,...`: one shard per GPU, each a separate
    `python -m grading --shard K/N` seeing only its GPU (CUDA_VISIBLE_DEVICES), so every lab is
    timed alone on its GPU as on a single-GPU machine; then the merged summary."""
    argv, skip = [], False
    for word in sys.argv[1:]:
        if skip:
            skip = False
        elif word == "--gpus":
            skip = True
        elif not word.startswith("--gpus="):
            argv.append(word)
    shards = []
    for index, gpu in enumerate(args.gpus):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        command = [sys.executable, "-m", "grading", *argv, "--shard", f"{index}/{len(args.gpus)}"]
        shards.append(subprocess.Popen(command, env=env))
    codes = [shard.wait() for shard in shards]
    summary = merge(args.submissions, args.out)
    progress = summary["progress"]
    print(f"{len(args.gpus)} GPUs: {len(progress['done'])}/{progress['students']} students done; "
          f"summary: {args.out / 'summary.md'}")
    return max(codes)


def read_reports(out: Path) -> dict[str, dict]:
    """{student: report} of every readable OUT/students/<student>/report.json."""
    reports = {}
    for path in sorted((out / "students").glob("*/report.json")):
        try:
            reports[path.parent.name] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a report being written right now is replaced atomically: read it next time
    return reports


def stack_of(report: dict) -> tuple:
    fingerprint = report.get("fingerprint") or {}
    return tuple(fingerprint.get(key) for key in STACK_KEYS)


def speed_of(lab: dict) -> float | None:
    """Median over a lab's timed configurations of the reference kernel's time over the student's
    (1.0: as fast as the course's kernel), or None where nothing was timed."""
    ratios = [perf["ratio_to_reference"] for function in lab.get("functions", [])
              for perf in function.get("perf") or [] if perf.get("ratio_to_reference")]
    return statistics.median(ratios) if ratios else None


def merge(submissions: Path | None, out: Path) -> dict:
    """Rebuild OUT/summary.{json,csv,md,png} from the per-student reports; returns the summary with
    a `progress` section (done, partial, failed, missing students; reports on another stack)."""
    reports = read_reports(out)
    expected = set(reports)
    if submissions is not None:
        expected |= {d.name for d in submissions.iterdir()
                     if d.is_dir() and not d.name.startswith(".")}
    lab_ids = sorted({lab["lab"] for r in reports.values() for lab in r.get("labs", [])})
    students = {}
    for student in sorted(expected):
        labs = {lab["lab"]: lab for lab in reports.get(student, {}).get("labs", [])}
        students[student] = {lab_id: labs.get(lab_id) for lab_id in lab_ids}
    partial = any(r.get("partial") for r in reports.values()) or len(reports) < len(expected)
    summary = report_mod.summary(students, lab_ids, date=now(), partial=partial,
                                 grader_version=grader_version())

    stacks = collections.Counter(stack_of(r) for r in reports.values())
    usual = stacks.most_common(1)[0][0] if stacks else None
    summary["progress"] = {
        "students": len(expected),
        "done": sorted(s for s, r in reports.items() if not r.get("partial")),
        "partial": sorted(s for s, r in reports.items() if r.get("partial")),
        "failed": sorted(s for s, r in reports.items()
                         if any(lab.get("error") for lab in r.get("labs", []))),
        "missing": sorted(expected - set(reports)),
        "usual_stack": dict(zip(STACK_KEYS, usual)) if usual else None,
        "other_stack": {s: dict(zip(STACK_KEYS, stack_of(r))) for s, r in reports.items()
                        if stack_of(r) != usual},
    }
    summary["speed"] = {lab_id: [speed_of(labs[lab_id]) for labs in students.values()
                                 if labs.get(lab_id) and speed_of(labs[lab_id]) is not None]
                        for lab_id in lab_ids}
    write_atomically(out / "summary.json",
                     json.dumps(report_mod.json_safe(summary), indent=1, default=str))
    write_atomically(out / "summary.csv", report_mod.summary_csv(summary))
    write_atomically(out / "summary.md",
                     report_mod.summary_markdown(summary) + progress_markdown(summary))
    plot(summary, out / "summary.png")
    return summary


def progress_markdown(summary: dict) -> str:
    progress = summary["progress"]
    lines = ["", "## Progress", "",
             f"- {len(progress['done'])} of {progress['students']} students done, "
             f"{len(progress['partial'])} partial, {len(progress['missing'])} missing, "
             f"{len(progress['failed'])} with a lab the grader could not finish"]
    for key in ("partial", "missing", "failed"):
        if progress[key]:
            lines.append(f"- {key}: {', '.join(progress[key])}")
    if progress["other_stack"]:
        usual = progress["usual_stack"]
        lines.append("- graded on another GPU or software stack than the rest "
                     f"({_stack_text(usual)}):")
        lines += [f"  - {student}: {_stack_text(stack)}"
                  for student, stack in progress["other_stack"].items()]
    lines += ["", "![grades and speed per lab](summary.png)", ""]
    return "\n".join(lines)


def _stack_text(stack: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in stack.items() if value is not None)


def plot(summary: dict, path: Path) -> None:
    """Two panels: the class's grades per lab, and each lab's speed against the course's kernel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lab_ids = summary["labs"]
    grades = ["A", "B", "C", "D", "F", "not measured"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(lab_ids))
    for i, lab_id in enumerate(lab_ids):
        counts = collections.Counter(row["labs"][lab_id]["grade"] or "missing"
                                     for row in summary["students"])
        left.bar([g + i * width for g in range(len(grades))], [counts.get(g, 0) for g in grades],
                 width, label=lab_id)
    left.set_xticks([g + 0.4 - width / 2 for g in range(len(grades))], grades)
    left.set_ylabel("students")
    left.set_title("grades per lab")
    left.legend(fontsize=7)
    speeds = [summary["speed"][lab_id] for lab_id in lab_ids]
    if any(speeds):
        right.boxplot([s or [math.nan] for s in speeds], tick_labels=lab_ids)
        right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        right.set_ylabel("course kernel's time / student's (median)")
    else:
        right.text(0.5, 0.5, "no timings (CPU mode)", ha="center", va="center")
    right.set_title("speed against the course's kernels")
    right.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sbatch_script(submissions: Path, out: Path, shards: int, *, gpu: bool, labs_per_shard: int,
                  python: str) -> str:
    """A Slurm job array: one task per shard, its time limit from the grader's per-lab limit."""
    minutes = math.ceil((labs_per_shard * LAB_TIMEOUT_S + TASK_OVERHEAD_S) / 60)
    lines = ["#!/bin/bash",
             "#SBATCH --job-name=grade-class",
             f"#SBATCH --array=0-{shards - 1}",
             "#SBATCH --ntasks=1",
             "#SBATCH --cpus-per-task=1",
             f"#SBATCH --time={minutes}",
             f"#SBATCH --output={out}/shards/slurm-%A_%a.log"]
    if gpu:
        lines.append("#SBATCH --gres=gpu:1")
    lines += ["set -euo pipefail",
              f"cd {Path.cwd()}",
              f"exec {python} -m grading --submissions {submissions} --out {out} "
              "--shard ${SLURM_ARRAY_TASK_ID}/${SLURM_ARRAY_TASK_COUNT}"
              + ("" if gpu else " --cpu")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading.classroom", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    merge_parser = sub.add_parser("merge", help="OUT/summary.* from the per-student reports")
    sbatch_parser = sub.add_parser("sbatch", help="a Slurm job-array script, one task a shard")
    for p in (merge_parser, sbatch_parser):
        p.add_argument("--submissions", type=Path, required=p is sbatch_parser)
        p.add_argument("--out", type=Path, required=True)
    sbatch_parser.add_argument("--shards", type=int, required=True)
    sbatch_parser.add_argument("--gpu", action="store_true", help="one GPU per task (--gres=gpu:1)")
    args = parser.parse_args(argv)
    if args.command == "merge":
        summary = merge(args.submissions, args.out)
        progress = summary["progress"]
        print(f"{len(progress['done'])}/{progress['students']} students done, "
              f"{len(progress['partial'])} partial, {len(progress['missing'])} missing; "
              f"summary: {args.out / 'summary.md'}")
        return 0
    counts = {d.name: len(student_notebooks(d, None)) for d in sorted(args.submissions.iterdir())
              if d.is_dir() and not d.name.startswith(".")}
    shards = assign_shards(counts, args.shards)
    per_shard = collections.Counter()
    for student, shard in shards.items():
        per_shard[shard] += counts[student]
    sys.stdout.write(sbatch_script(args.submissions.resolve(), args.out.resolve(), args.shards,
                                   gpu=args.gpu, labs_per_shard=max(per_shard.values(), default=1),
                                   python=sys.executable))
    return 0


if __name__ == "__main__":
    sys.exit(main())
