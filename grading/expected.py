"""Expected-results tables: data/expected/<lab>.yaml, per GPU model.

For each performance configuration of a lab, what the course's reference kernel and PyTorch took on
a
GPU model, and the times that reach the tiers (target: 70% of the reference's speed, excellent:
80%).
Rows come from measurements made by this project (`python -m grading solutions --write-expected` on
the GPU, which grades the reference solutions and records what it timed, with the run's
fingerprint);
rows for GPUs not measured here say so.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kernels import runtime

EXPECTED_DIR = Path(__file__).resolve().parents[1] / "data" / "expected"
TARGET, EXCELLENT = 0.7, 0.8


def path(lab_id: str) -> Path:
    return EXPECTED_DIR / f"{lab_id}.yaml"


def load(lab_id: str, gpu_slug: str | None = None) -> dict | None:
    """The table's entry for this GPU model (or `gpu_slug`), or None if the model has no row."""
    p = path(lab_id)
    if not p.exists():
        return None
    table = yaml.safe_load(p.read_text()) or {}
    info = runtime.gpu_info()
    slug = gpu_slug or (info.slug if info else None)
    return (table.get("gpus") or {}).get(slug)


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


def write(
    lab_id: str, title: str, function_results: list[dict], fingerprint: dict, source: str
) -> Path:
    """Record this GPU's row from a grading run of the reference solutions (GPU mode)."""
    p = path(lab_id)
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
        "status": "measured",
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
