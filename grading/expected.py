"""Expected-results tables: data/expected/<lab>.yaml, per GPU model.

For each performance configuration of a lab, what the course's reference kernel and PyTorch took on
a GPU model, and the times that reach the tiers (target: 70% of the reference's speed, excellent:
80%). A GPU's row comes from the first of these that has one, and its `status` says which:

1. "measured on this machine": `python -m grading calibrate` on the student's own GPU, written to
   grading-reports/calibrated/<lab>.yaml (not part of the repository; KERNELS_CALIBRATED_DIR moves
   it);
2. "measured": this project's runs (`python -m grading solutions --write-expected` on the GPU,
   which grades the reference solutions and records what it timed, with the run's fingerprint);
3. "predicted, not measured": data/expected/predicted/<lab>.yaml, from the GPU's published
   bandwidth and peak rates and the efficiency the course's kernels reach on a measured GPU
   (tools/predict_expected.py; the formula is in data/expected/README.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from kernels import runtime

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_DIR = ROOT / "data" / "expected"
PREDICTED_DIR = EXPECTED_DIR / "predicted"
CALIBRATED_DIR = Path(
    os.environ.get("KERNELS_CALIBRATED_DIR", ROOT / "grading-reports" / "calibrated")
)
TARGET, EXCELLENT = 0.7, 0.8
MEASURED, CALIBRATED, PREDICTED = "measured", "measured on this machine", "predicted, not measured"


def path(lab_id: str, folder: Path = EXPECTED_DIR) -> Path:
    return folder / f"{lab_id}.yaml"


def _entry(table_path: Path, slug: str | None) -> dict | None:
    if slug is None or not table_path.exists():
        return None
    table = yaml.safe_load(table_path.read_text()) or {}
    return (table.get("gpus") or {}).get(slug)


def load(lab_id: str, gpu_slug: str | None = None) -> dict | None:
    """This GPU model's (or `gpu_slug`'s) entry: calibrated here, else measured by the course,
    else predicted; None if the model has none."""
    info = runtime.gpu_info()
    slug = gpu_slug or (info.slug if info else None)
    for folder in (CALIBRATED_DIR, EXPECTED_DIR, PREDICTED_DIR):
        entry = _entry(path(lab_id, folder), slug)
        if entry is not None:
            return entry
    return None


# The software a table's timings depend on, compared without local labels (2.11.0+cu130 = 2.11.0).
STACK_KEYS = ("torch", "triton", "cupy", "cuda", "driver")


def stack_differences(lab_id: str, fingerprint: dict) -> dict[str, tuple[str, str]]:
    """{package: (yours, the table's)} where the run's software differs from what this GPU's row of
    the lab's expected table was measured with; empty where they agree or the GPU has no row."""
    entry = load(lab_id, fingerprint.get("gpu_slug"))
    recorded = (entry or {}).get("fingerprint") or {}
    differences = {}
    for key in STACK_KEYS:
        yours, table = fingerprint.get(key), recorded.get(key)
        if yours is not None and table is not None:
            if str(yours).split("+")[0] != str(table).split("+")[0]:
                differences[key] = (str(yours), str(table))
    return differences


def row(entry: dict | None, config_id: str) -> dict | None:
    if not entry:
        return None
    config = (entry.get("configs") or {}).get(config_id)
    return (
        None
        if config is None
        else {"gpu": entry.get("gpu"), "status": entry.get("status"), **config}
    )


def timed_anything(lab: dict) -> bool:
    """Whether a graded lab has a timed configuration: one that has none (lab 08, or a lab whose
    timed functions failed) has no row to write, and its table is left as it is."""
    return any(f.get("perf") for f in lab.get("functions", []))


def write(
    lab_id: str,
    title: str,
    function_results: list[dict],
    fingerprint: dict,
    source: str,
    folder: Path = EXPECTED_DIR,
    status: str = MEASURED,
) -> Path:
    """Record this GPU's row from a grading run of the reference solutions (GPU mode), in the
    repository's table or (`folder`, `status`) this machine's calibrated one."""
    p = path(lab_id, folder)
    table = (yaml.safe_load(p.read_text()) if p.exists() else None) or {}
    table.setdefault("lab", lab_id)
    table.setdefault("title", title)
    table["tiers"] = {
        "target": f">= {TARGET:.0%} of the reference kernel's speed (B)",
        "excellent": f">= {EXCELLENT:.0%} (A)",
    }
    configs = {}
    for fr in function_results:
        for perf in fr.get("perf", []):
            ref = perf["reference_us"]
            configs[perf["config"]] = {
                "reference_us": round(ref, 2),
                "reference_gbps": round(perf["nbytes"] / (ref * 1e-6) / 1e9, 1),
                "torch_us": round(perf["torch_us"], 2),
                "target_us": round(ref / TARGET, 2),
                "excellent_us": round(ref / EXCELLENT, 2),
            }
    table.setdefault("gpus", {})[fingerprint["gpu_slug"]] = {
        "gpu": fingerprint["gpu"],
        "status": status,
        "source": source,
        # str(): torch.__version__ is a str subclass that yaml.safe_dump refuses
        "fingerprint": {
            k: str(fingerprint[k])
            for k in ("gpu", "driver", "cuda", "torch", "triton", "cupy", "date")
        },
        "configs": configs,
    }
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(table, sort_keys=False, width=110))
    return p
