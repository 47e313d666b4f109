"""`python -m grading [PATH ...]`: grade lab notebooks and write a JSON and a Markdown report.

PATH is a lab notebook or a folder of them (default: labs/). Each lab is graded in its own process with
a timeout, using the solution cells of the student's notebook, the locked cells of the source notebook
in solutions/, and a fresh secret seed (or --seed, to reproduce a run). Reports go to --out (default
grading-reports/ under the current directory); nothing is written next to the notebooks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grading import report as report_mod
from grading.labs import LAB_MODULES
from grading.notebooks import lab_id_of, source_path_for


def find_notebooks(paths: list[Path], only_lab: str | None) -> list[Path]:
    found = []
    for p in paths:
        if p.is_dir():
            found += sorted(p.glob("*_lab.ipynb"))
        elif p.suffix == ".ipynb":
            found.append(p)
        else:
            raise SystemExit(f"grading: {p} is neither a folder nor a .ipynb notebook")
    found = [nb for nb in found if only_lab is None or lab_id_of(nb) == only_lab]
    unknown = [nb.name for nb in found if lab_id_of(nb) not in LAB_MODULES]
    if unknown:
        raise SystemExit(f"grading: no lab spec for {', '.join(unknown)} (known: {', '.join(LAB_MODULES)})")
    return found


def grade_one(notebook: Path, seed: int, timeout: float, cpu: bool) -> dict:
    lab_id = lab_id_of(notebook)
    notebook = notebook.resolve()  # the worker runs in a scratch directory
    source = source_path_for(notebook)
    base = {"lab": lab_id, "notebook": str(notebook), "seed": seed, "functions": [], "notes": []}
    with tempfile.TemporaryDirectory(prefix="grading-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "grading.worker", "--notebook", str(notebook), "--source", str(source),
               "--lab", lab_id, "--seed", str(seed), "--out", str(out)] + (["--cpu"] if cpu else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return {**base, "error": f"timed out after {timeout:.0f} s (an infinite loop or a hung kernel?)"}
        if out.exists():
            return json.loads(out.read_text())
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return {**base, "error": f"the grading process died (exit code {proc.returncode}): {tail}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("labs")])
    parser.add_argument("--out", type=Path, default=Path("grading-reports"), help="report folder")
    parser.add_argument("--lab", help="grade only this lab id, e.g. 01_elementwise_add")
    parser.add_argument("--cpu", action="store_true", help="force CPU mode (Triton interpreter) even on a GPU")
    parser.add_argument("--seed", type=int, help="reproduce a run (default: a fresh secret seed per lab)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per lab")
    parser.add_argument("--jobs", type=int, default=1,
                        help="labs graded at once (CPU mode only: on a GPU, concurrent labs would distort timings)")
    parser.add_argument("--write-expected", action="store_true",
                        help="(instructors, on a GPU, grading solutions/) record the timings in data/expected/")
    args = parser.parse_args(argv)

    notebooks = find_notebooks(args.paths, args.lab)
    if not notebooks:
        print("grading: no *_lab.ipynb notebooks found", file=sys.stderr)
        return 1
    from tqdm.auto import tqdm

    from kernels import runtime
    jobs = args.jobs if (args.cpu or not runtime.ON_GPU) else 1
    seeds = [args.seed if args.seed is not None else secrets.randbits(31) for _ in notebooks]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # each lab is its own process anyway
        futures = [pool.submit(grade_one, nb, seed, args.timeout, args.cpu) for nb, seed in zip(notebooks, seeds)]
        labs = [f.result() for f in tqdm(futures, desc="grading", unit="lab")]
    for lab in labs:
        lab["score"] = report_mod.score_lab(lab)
    fingerprint = next((lab["fingerprint"] for lab in labs if "fingerprint" in lab), runtime.fingerprint())
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "fingerprint": fingerprint, "labs": labs}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=1, default=str)),
                       ("report.md", report_mod.markdown(report))):
        tmp = args.out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out / name)  # atomic: a reader never sees half a report
    for lab in labs:
        s = lab["score"]
        print(f"{lab['lab']}: {s['points']}/{s['max_points']} points, grade {s['grade']}"
              + (f"  [{lab['error']}]" if lab.get("error") else ""))
    print(f"report: {args.out / 'report.md'}")
    if args.write_expected:
        from grading import expected
        from grading.labs import get_lab
        if fingerprint.get("mode") != "gpu":
            print("grading: --write-expected needs a GPU", file=sys.stderr)
            return 1
        for lab in labs:
            path = expected.write(lab["lab"], get_lab(lab["lab"]).title, lab["functions"], fingerprint,
                                  source=str(args.out / "report.json"))
            print(f"wrote {path}")
    return 0
