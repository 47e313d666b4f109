"""Refresh this GPU model's measurements: benchmarks, expected tables, notebook outputs.

    make refresh-gpu                       # every phase: bench, grade, notebooks
    make refresh-gpu PHASES="bench grade"  # some of them (each phase fits a 10-minute slot)

For an instructor with a GPU model the tables lack (or after a driver or software change):
  bench      python -m kernels.<topic>.benchmark for every topic, and the benchmarks in files of
             their own (OWN_FILE_BENCHMARKS) -> data/results/<gpu>/*.json
  grade      grade solutions/ with performance and write this GPU's rows of data/expected/, then
             grade the untouched labs/ (which must score zero)
  notebooks  execute every lecture and solution notebook in place: the outputs that are committed
Every phase runs even if one fails. At the end it prints what changed (git status) and, per expected
table, each reference time that moved, old -> new, so the commit can say what the new GPU changed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kernels import runtime

ROOT = Path(__file__).resolve().parents[1]
TOPICS = (
    "elementwise_add",
    "rmsnorm",
    "flash_attention",
    "mixed_precision",
    "memory_profiling",
    "moe",
    "decoder",
    "matmul",
)
# Benchmarks in files of their own beside a topic's benchmark.py, with the device feature each needs
# (kernels.runtime.has); any other benchmark_*.py is a helper that its benchmark.py starts.
OWN_FILE_BENCHMARKS = {
    "flash_attention.benchmark_host": None,
    "flash_attention.benchmark_gluon": "wgmma",
    "flash_attention.benchmark_gluon_backward": "wgmma",
    "decoder.benchmark_gemv": None,
    "decoder.benchmark_fused_gemv": None,
    "matmul.benchmark_hopper": "wgmma",
}
PHASES = ("bench", "grade", "notebooks")


def run(command: list[str], log: Path) -> bool:
    """Run `command` from the repository root, its output to the terminal and to `log`."""
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    with open(log, "a") as sink:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in process.stdout:
            sys.stdout.write(line)
            sink.write(line)
        ok = process.wait() == 0
    print(f"  {'ok' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)
    return ok


def expected_reference_times() -> dict[tuple[str, str, str], float]:
    """{(lab, gpu, config): reference_us} over every expected table."""
    times = {}
    for table_path in sorted((ROOT / "data" / "expected").glob("*.yaml")):
        table = yaml.safe_load(table_path.read_text()) or {}
        for gpu, row in (table.get("gpus") or {}).items():
            for config, values in (row.get("configs") or {}).items():
                if isinstance(values, dict) and "reference_us" in values:
                    times[(table_path.stem, gpu, config)] = values["reference_us"]
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", nargs="*", default=list(PHASES), choices=PHASES)
    args = parser.parse_args()
    if not runtime.ON_GPU:
        print("refresh-gpu measures this GPU: no CUDA GPU is visible here.", file=sys.stderr)
        return 2
    slug = runtime.gpu_info().slug
    results = ROOT / "data" / "results" / slug
    results.mkdir(parents=True, exist_ok=True)
    (results / "environment.json").write_text(json.dumps(runtime.fingerprint(), indent=1) + "\n")
    log = results / f"refresh-{time.strftime('%Y-%m-%d')}.log"
    before = expected_reference_times()
    python = sys.executable
    ok = True
    for phase in args.phases:
        print(f"=== {phase} on {runtime.gpu_info().name}", flush=True)
        if phase == "bench":
            for topic in TOPICS:
                if (ROOT / "kernels" / topic / "benchmark.py").is_file():
                    ok &= run([python, "-m", f"kernels.{topic}.benchmark"], log)
            for module, feature in OWN_FILE_BENCHMARKS.items():
                if feature is None or runtime.has(feature):
                    ok &= run([python, "-m", f"kernels.{module}"], log)
                else:
                    print(f"skipping kernels.{module}: this GPU lacks {feature}", flush=True)
        elif phase == "grade":
            ok &= run(
                [
                    python,
                    "-m",
                    "grading",
                    "solutions",
                    "--write-expected",
                    "--out",
                    f"data/results/{slug}/grading/solutions-all-labs",
                ],
                log,
            )
            labs_out = f"data/results/{slug}/grading/labs-unsolved"
            ok &= run([python, "-m", "grading", "labs", "--out", labs_out], log)
        elif phase == "notebooks":
            notebooks = sorted(map(str, (ROOT / "notebooks").glob("*.ipynb")))
            solutions = sorted(map(str, (ROOT / "solutions").glob("*.ipynb")))
            ok &= run([python, "tools/execute_notebooks.py", *notebooks, *solutions], log)

    print("=== what changed")
    subprocess.run(["git", "status", "--short", "data", "notebooks", "solutions"], cwd=ROOT)
    after = expected_reference_times()
    for key in sorted(after.keys() | before.keys()):
        old, new = before.get(key), after.get(key)
        if old != new:
            lab, gpu, config = key
            print(f"  {lab} [{gpu}] {config}: reference {old} -> {new} us")
    print(f"log: {log.relative_to(ROOT)}; {'all phases passed' if ok else 'some phase FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
