"""Nsight Compute over one of the course's kernels, and its CSV report read back.

    python -m kernels.profiling.ncu add rmsnorm       # or: all, or matmul (its missed targets)
    python -m kernels.profiling.ncu --list

profiles each named workload (`kernels.profiling.workloads`) in its own process and writes, for
each, data/results/<gpu>/00_profiling/ncu_<name>.csv (ncu's raw page: one row per kernel, every
metric collected, base units) and ncu_<name>.json (the workload's compulsory bytes and flops, the
command, ncu's version and the environment fingerprint). An instructor refreshes the committed
profiles of a new GPU with `python -m kernels.profiling.ncu all`.

How it runs ncu, and why:
* `--profile-from-start off`: only the kernels between cudaProfilerStart and cudaProfilerStop, i.e.
  the one call the workload makes after its warm-up;
* `--clock-control none`: the GPU's own clocks, as in every other measurement of the course (by
  default ncu locks the base clock, which makes kernels slower than they run);
* `--cache-control all` (the default): caches flushed before each replay pass, as `kernels.bench`
  flushes L2 before each repetition;
* sections SpeedOfLight, Occupancy, LaunchStats and MemoryWorkloadAnalysis, plus the metrics in
  `METRICS` (bytes per memory level, load efficiency, tensor pipes, flop counters);
  a workload adds its own (`Workload.sections`, `.metrics`: the matrix multiply's missed targets
  ask for the warps' stall reasons and shared memory's bank conflicts);
* `--export` then `--import --csv --page raw --print-units base`: the app's own output never mixes
  with the CSV, and every value is in bytes, nanoseconds, percent or counts. The `details` page (the
  sections as the GUI shows them, with ncu's rule messages) is stored beside it, as
  ncu_<name>.details.csv.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels import runtime

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "data" / "results"
SUBDIR = "00_profiling"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis")
# name -> what it says. Metrics this ncu does not know are dropped (and listed in the JSON).
METRICS = {
    "gpu__time_duration.sum": "kernel duration",
    "sm__cycles_elapsed.avg.per_second": "SM clock",
    "dram__bytes_read.sum": "bytes read from DRAM (HBM)",
    "dram__bytes_write.sum": "bytes written to DRAM",
    "lts__t_bytes.sum": "bytes through L2 (all requests)",
    "lts__t_sectors_srcunit_tex_op_read.sum": "32-byte sectors L1 read from L2",
    "lts__t_sectors_srcunit_tex_op_write.sum": "32-byte sectors L1 wrote to L2",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "global load sectors (L1)",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global load requests (one per warp)",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "global store sectors (L1)",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "global store requests",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput, % of peak",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory SOL %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "compute (SM) SOL %",
    "sm__cycles_active.avg.pct_of_peak_sustained_elapsed": "SM busy: % of cycles an SM had work",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical occupancy",
    "launch__registers_per_thread": "registers per thread",
    "launch__occupancy_limit_registers": "blocks per SM allowed by registers",
    "launch__occupancy_limit_shared_mem": "blocks per SM allowed by shared memory",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": (
        "tensor pipe (mma) active, % of peak"
    ),
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": (
        "tensor pipe (wgmma) active, % of peak"
    ),
    "sm__inst_executed_pipe_tensor_op_hmma.sum": "mma instructions",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "wgmma instructions",
    "sm__ops_path_tensor_src_bf16_dst_fp32.sum": "tensor-core ops, bf16 in, fp32 accumulate",
    "sm__ops_path_tensor_src_fp16_dst_fp32.sum": "tensor-core ops, fp16 in, fp32 accumulate",
    "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": "fp32 fused multiply-adds (per thread)",
    "smsp__sass_thread_inst_executed_op_fadd_pred_on.sum": "fp32 adds",
    "smsp__sass_thread_inst_executed_op_fmul_pred_on.sum": "fp32 multiplies",
}


# If ncu refuses the whole list, these (the lab's readings, the roofline's bytes) are tried alone.
CORE_METRICS = tuple(
    m for m in METRICS if not m.startswith(("sm__pipe", "sm__inst", "sm__ops", "smsp__"))
)

# --------------------------------------------------------------------------------------------------
# Reading a report


@dataclass
class KernelProfile:
    """One profiled kernel launch: its name, launch shape and every metric ncu reported."""

    name: str
    block: str
    grid: str
    values: dict  # metric -> float (or str where ncu gave text)
    units: dict  # metric -> unit ("byte", "nsecond", "%", ...)

    def get(self, metric: str, default=None):
        value = self.values.get(metric, default)
        return value if isinstance(value, float) else default

    def __getitem__(self, metric: str) -> float:
        value = self.values.get(metric)
        if not isinstance(value, float):
            raise KeyError(f"{self.name}: no numeric value for {metric} (got {value!r})")
        return value


def _number(text: str):
    """ncu's cell as a float where it is a number ("1,024.5" -> 1024.5), else the text."""
    t = text.strip().replace(",", "")
    try:
        return float(t)
    except ValueError:
        return text.strip()


def parse_csv(text: str) -> list[KernelProfile]:
    """ncu's raw page (`--csv --page raw`): a header of names, a row of units, one row per
    kernel."""
    lines = [line for line in text.splitlines() if line.startswith('"')]  # drop ==PROF== lines
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2 or "Kernel Name" not in rows[0]:
        raise ValueError("not an ncu raw-page CSV: no header with 'Kernel Name'")
    header, units, kernels = rows[0], rows[1], rows[2:]
    profiles = []
    for row in kernels:
        cells = dict(zip(header, row))
        profiles.append(
            KernelProfile(
                name=cells["Kernel Name"],
                block=cells.get("Block Size", ""),
                grid=cells.get("Grid Size", ""),
                values={h: _number(v) for h, v in cells.items() if "__" in h},
                units={h: u for h, u in zip(header, units) if "__" in h},
            )
        )
    return profiles


def read_csv(path) -> list[KernelProfile]:
    return parse_csv(Path(path).read_text())


def rules(details_path) -> list[dict]:
    """ncu's rule messages from a details-page CSV (`--page details`), one per rule that fired:
    {"section", "rule", "type", "description", "speedup"}."""
    seen, out = set(), []
    with open(details_path, newline="") as f:
        for row in csv.DictReader(line for line in f if line.startswith('"')):
            name = row.get("Rule Name")
            if name and name not in seen:
                seen.add(name)
                out.append(
                    {
                        "section": row["Section Name"],
                        "rule": name,
                        "type": row["Rule Type"],
                        "description": row["Rule Description"],
                        "speedup": row.get("Estimated Speedup", ""),
                    }
                )
    return out


def results_dir(gpu_slug: str | None = None) -> Path:
    return RESULTS_DIR / (gpu_slug or runtime.gpu_info().slug) / SUBDIR


def committed_gpus() -> list[str]:
    """GPU slugs that have committed ncu profiles, sorted."""
    return sorted({p.parent.parent.name for p in RESULTS_DIR.glob(f"*/{SUBDIR}/ncu_*.csv")})


def load(
    name: str, gpu_slug: str | None = None, folder: Path | None = None
) -> tuple[list[KernelProfile], dict]:
    """The profile of workload `name`, committed for `gpu_slug` (or written into `folder`):
    its kernels and its metadata."""
    folder = Path(folder) if folder is not None else results_dir(gpu_slug)
    meta = json.loads((folder / f"ncu_{name}.json").read_text())
    return read_csv(folder / f"ncu_{name}.csv"), meta


def main_kernel(profiles: list[KernelProfile], pattern: str | None = None) -> KernelProfile:
    """The launch that matters: the longest one whose name matches `pattern` (all, if none does)."""
    matching = [p for p in profiles if pattern and re.search(pattern, p.name)] or profiles
    if not matching:
        raise ValueError("the report has no kernels")
    return max(matching, key=lambda p: p.get("gpu__time_duration.sum", 0.0))


# --------------------------------------------------------------------------------------------------
# Running ncu


def in_repo() -> dict:
    """subprocess.run arguments that let a child `python -m kernels...` import this package wherever
    the parent runs (a notebook's working directory is notebooks/)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {"cwd": REPO, "env": {**os.environ, "PYTHONPATH": path}}


def ncu_path() -> str | None:
    return shutil.which("ncu")


def ncu_version(ncu: str) -> str:
    out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    return out.strip().splitlines()[-1] if out.strip() else "unknown"


def available_metrics(ncu: str) -> set[str] | None:
    """Base names of the metrics this ncu knows for this GPU (None if it cannot say)."""
    try:
        out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    except (subprocess.SubprocessError, OSError):
        return None
    names = {line.split()[0] for line in out.stdout.splitlines() if "__" in line.split(" ")[0]}
    return names or None


def base_name(metric: str) -> str:
    """dram__bytes_read.sum -> dram__bytes_read; sm__warps_active.avg.pct_of_... ->
    sm__warps_active."""
    return metric.split(".")[0]


def profile_command(
    ncu: str, name: str, metrics: list[str], report: Path, extra_sections: tuple[str, ...] = ()
) -> list[str]:
    sections = [arg for s in (*SECTIONS, *extra_sections) for arg in ("--section", s)]
    return [
        ncu,
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--launch-count",
        "8",
        *sections,
        *(["--metrics", ",".join(metrics)] if metrics else []),
        "--export",
        str(report),
        "--force-overwrite",
        sys.executable,
        "-m",
        "kernels.profiling.workloads",
        name,
    ]


def profile(
    name: str, out_dir: Path | None = None, *, known: set[str] | None = None, timeout: float = 300
) -> Path:
    """Profile workload `name` with ncu; write ncu_<name>.csv and .json into `out_dir`; return the
    CSV.

    If ncu rejects the extra metrics, `CORE_METRICS`, then the sections alone are collected, and
    the JSON says which metrics were dropped."""
    from kernels.profiling import workloads

    ncu = ncu_path()
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute's command line) is not on PATH")
    work = workloads.get(name)
    out_dir = Path(out_dir) if out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = [*METRICS, *work.metrics]
    metrics = [m for m in wanted if known is None or base_name(m) in known]
    log = []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / f"{name}.ncu-rep"
        core = [m for m in metrics if m in CORE_METRICS]
        for attempt in (metrics, core, []):
            cmd = profile_command(ncu, name, attempt, report, work.sections)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **in_repo())
            log.append(
                {
                    "command": cmd,
                    "returncode": proc.returncode,
                    "stderr_tail": proc.stderr[-2000:],
                    "stdout_tail": proc.stdout[-2000:],
                }
            )
            if proc.returncode == 0 and report.exists():
                metrics = attempt
                break
        else:
            raise RuntimeError(
                f"ncu failed on {name}: {log[-1]['stderr_tail'] or log[-1]['stdout_tail']}"
            )
        pages = {
            page: subprocess.run(
                [ncu, "--import", str(report), "--csv", "--page", page, "--print-units", "base"],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=True,
            ).stdout
            for page in ("raw", "details")
        }
    parse_csv(pages["raw"])  # refuse to store what cannot be read back
    csv_path = out_dir / f"ncu_{name}.csv"
    csv_path.write_text(pages["raw"])
    # the sections as the GUI shows them, with ncu's rules ("uncoalesced global accesses ...")
    (out_dir / f"ncu_{name}.details.csv").write_text(pages["details"])
    meta = {
        "workload": name,
        "what": work.what,
        "kernel": work.kernel,
        "bytes": work.bytes,
        "flops": work.flops,
        "tensor_cores": work.tensor_cores,
        "ncu": ncu_version(ncu),
        "sections": [*SECTIONS, *work.sections],
        "metrics": metrics,
        "metrics_dropped": [m for m in wanted if m not in metrics],
        "command": " ".join(log[-1]["command"][:-4]).replace(str(report), report.name)
        + f" python -m kernels.profiling.workloads {name}",
        "fingerprint": runtime.fingerprint(),
    }
    (out_dir / f"ncu_{name}.json").write_text(json.dumps(meta, indent=1))
    return csv_path


def main(argv=None) -> int:
    from kernels.profiling import workloads

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="workloads to profile, 'all' or 'matmul'")
    parser.add_argument("--list", action="store_true", help="list the workloads")
    parser.add_argument(
        "--out", type=Path, help="folder (default: data/results/<gpu>/00_profiling)"
    )
    args = parser.parse_args(argv)
    if args.list or not args.names:
        for w in workloads.WORKLOADS.values():
            print(f"{w.name:16} {w.what}")
        return 0
    if not runtime.ON_GPU:
        print("ncu profiles need a GPU", file=sys.stderr)
        return 1
    groups = {"all": workloads.PROFILED, "matmul": workloads.MATMUL_WHY}
    names = [n for name in args.names for n in groups.get(name, (name,))]
    known = available_metrics(ncu_path() or "ncu")
    failed = []
    for name in names:
        try:
            path = profile(name, args.out, known=known)
            kernel = main_kernel(read_csv(path), workloads.get(name).kernel)
            print(
                f"{name}: {kernel.name[:60]} "
                f"{kernel.get('gpu__time_duration.sum', 0) / 1e3:.1f} us "
                f"-> {path}"
            )
        except Exception as exc:  # noqa: BLE001 - one failing profile must not lose the others
            failed.append(name)
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
