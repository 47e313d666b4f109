"""Every profile the lesson shows, measured on this GPU and written to
data/results/<gpu>/00_profiling/.

    python -m kernels.profiling.collect            # about 5 minutes on an H100
    python -m kernels.profiling.collect --only traces proton

Steps (each one's failure is reported and the next runs):
* `timings`: the measured ceilings (kernels.bench.ceilings) and every workload timed with CUDA
events
  (kernels.bench.benchmark: warm-up, L2 flushed, median), for comparison with ncu's durations;
* `ncu`: Nsight Compute over every workload (kernels.profiling.ncu), one process each;
* `traces`: torch.profiler on a training step of the small GPT, float32 and bf16 autocast:
  trimmed Chrome traces, key_averages tables and summaries;
* `proton`: Triton's profiler on the lab's two transposes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from kernels import bench, runtime
from kernels.profiling import ncu, trace, workloads

# The profiled training step: GPT-2 small's width and vocabulary, 4 layers, 8 x 512 tokens.
GPT_LAYERS, GPT_BATCH, GPT_SEQ = 4, 8, 512
STEPS = ("timings", "ncu", "traces", "proton")
NCU_TIMEOUT_S = 90


def gpt_config():
    from kernels.memory_profiling.gpt import GPTConfig

    return GPTConfig(layers=GPT_LAYERS, max_seq=GPT_SEQ)


def _write(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def timings(out: Path) -> None:
    ceil = bench.ceilings(refresh=True)
    rows = {}
    for name, work in workloads.WORKLOADS.items():
        call = work.build()
        t = bench.benchmark({name: call})[name]
        rows[name] = {**t.summary(), "bytes": work.bytes, "flops": work.flops}
        print(f"  {name:16} {t.median_us:9.1f} us", flush=True)
        del call
        torch.cuda.empty_cache()
    _write(
        out / "timings.json",
        {
            "ceilings": {k: ceil[k] for k in ("copy_gbps", "matmul_bf16_tflops")},
            "events": rows,
            "fingerprint": runtime.fingerprint(),
        },
    )


def profile_ncu(out: Path) -> None:
    path = ncu.ncu_path()
    if path is None:
        raise RuntimeError("ncu is not on PATH")
    known = ncu.available_metrics(path)
    print(
        f"  {ncu.ncu_version(path)}; metrics known: {len(known) if known else 'unknown'}",
        flush=True,
    )
    for name in workloads.PROFILED:
        t0 = time.perf_counter()
        try:
            csv_path = ncu.profile(name, out, known=known, timeout=NCU_TIMEOUT_S)
            k = ncu.main_kernel(ncu.read_csv(csv_path), workloads.get(name).kernel)
            print(
                f"  {name:16} {k.get('gpu__time_duration.sum', 0) / 1e3:9.1f} us  "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - one failing profile must not lose the others
            print(f"  {name}: FAILED ({time.perf_counter() - t0:.0f} s): {exc}", flush=True)


def traces(out: Path) -> None:
    cfg = gpt_config()
    summaries = {}
    for label, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        prof = trace.profile_step(cfg, GPT_BATCH, GPT_SEQ, autocast=dtype)
        path = trace.export_trace(prof, out / f"trace_{label}.json")
        (out / f"key_averages_{label}.txt").write_text(trace.key_averages_table(prof))
        summaries[label] = trace.summary(trace.read_trace(path))
        print(
            f"  {label}: {path.stat().st_size / 1e6:.2f} MB, "
            f"{summaries[label]['kernels']} kernels, "
            f"window {summaries[label]['window_us']:.0f} us",
            flush=True,
        )
        del prof
    _write(
        out / "trace_summary.json",
        {
            "config": vars(cfg) | {"batch": GPT_BATCH, "seq": GPT_SEQ},
            "summaries": summaries,
            "fingerprint": runtime.fingerprint(),
        },
    )


def proton(out: Path) -> None:
    stem = out / "proton"
    subprocess.run(
        [sys.executable, "-m", "kernels.profiling.proton", str(stem.resolve())],
        check=True,
        timeout=300,
        **ncu.in_repo(),
    )
    print(f"  {stem}.hatchet", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument(
        "--out", type=Path, help="folder (default: data/results/<gpu>/00_profiling)"
    )
    args = parser.parse_args(argv)
    if not runtime.ON_GPU:
        print("the profiles need a GPU", file=sys.stderr)
        return 1
    out = args.out or ncu.results_dir()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for step in args.only:
        t0 = time.perf_counter()
        print(f"{step}:", flush=True)
        try:
            {"timings": timings, "ncu": profile_ncu, "traces": traces, "proton": proton}[step](out)
        except Exception:  # noqa: BLE001 - report it and go on with the next step
            failed.append(step)
            traceback.print_exc()
        print(f"{step}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
