"""What the command line and the class tools share: which notebooks are a student's, which shard
grades them, and files written whole.

`python -m grading --submissions DIR --shard K/N` (grading/cli.py) grades one shard; grading/
classroom.py runs shards over GPUs, merges their reports and writes a Slurm script. Both cut the
class the same way with the functions here.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
from pathlib import Path

from grading.labs import LAB_MODULES
from grading.notebooks import lab_id_of


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def student_notebooks(folder: Path, only_lab: str | None) -> dict[str, tuple[Path, list[str]]]:
    """A student's lab notebooks by lab id (any depth, checkpoints ignored), with notes on
    duplicates."""
    by_lab: dict[str, list[Path]] = {}
    for nb in sorted(folder.rglob("*.ipynb")):
        if ".ipynb_checkpoints" in nb.parts:
            continue
        lab_id = lab_id_of(nb, LAB_MODULES)
        if lab_id in LAB_MODULES and (only_lab is None or lab_id == only_lab):
            by_lab.setdefault(lab_id, []).append(nb)
    chosen = {}
    for lab_id, nbs in by_lab.items():
        exact = [nb for nb in nbs if nb.name == f"{lab_id}_lab.ipynb"]
        pick = exact[0] if exact else max(nbs, key=lambda p: p.stat().st_mtime)
        notes = (
            []
            if len(nbs) == 1
            else [
                "several notebooks for this lab "
                f"({', '.join(str(nb.relative_to(folder)) for nb in nbs)}): graded "
                f"{pick.relative_to(folder)}"
            ]
        )
        chosen[lab_id] = (pick, notes)
    return chosen


def write_atomically(path: Path, text: str) -> None:
    """Write, then rename: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), with 0 <= K < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes K/N (e.g. 0/4), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: K must be in 0..N-1 and N >= 1")
    return index, count


def parse_gpus(text: str) -> list[str]:
    """'0,1,3' -> ['0', '1', '3']: CUDA device indices, each used once."""
    gpus = [part.strip() for part in text.split(",") if part.strip()]
    if not gpus or not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(
            f"--gpus takes distinct device indices like 0,1,2, got {text!r}")
    return gpus


def hash_order(student: str) -> str:
    return hashlib.sha256(student.encode()).hexdigest()


def assign_shards(lab_counts: dict[str, int], count: int) -> dict[str, int]:
    """{student: shard}: hash order, cut into `count` runs of about equal numbers of labs.

    A student's shard is where the middle of their labs falls on the class's cumulative count, so
    shards differ by at most one student's labs from an even split."""
    order = sorted(lab_counts, key=hash_order)
    total = sum(max(1, lab_counts[s]) for s in order)
    shards, before = {}, 0
    for student in order:
        weight = max(1, lab_counts[student])
        shards[student] = min(count - 1, int((before + weight / 2) * count / total))
        before += weight
    return shards


def shard_status_path(out: Path, index: int, count: int) -> Path:
    return out / "shards" / f"{index}-of-{count}.json"


def write_shard_status(out: Path, shard: tuple[int, int], final: dict, *, partial: bool) -> None:
    """OUT/shards/K-of-N.json: which students this shard graded and whether it finished."""
    index, count = shard
    status = {"shard": f"{index}/{count}", "date": now(), "partial": partial,
              # the GPU this shard saw (--gpus, or what Slurm's gres set); None: all, or none
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "students": sorted(final),
              "labs": sum(lab is not None for labs in final.values() for lab in labs.values())}
    write_atomically(shard_status_path(out, index, count), json.dumps(status, indent=1))
