"""Predict the expected-table rows of GPUs the course has not measured, from a measured one.

    python tools/predict_expected.py            # writes data/expected/predicted/<lab>.yaml

For each timed configuration, the work it must do (bytes moved, flops: the lab spec's own
`bytes_moved` and `flops`, evaluated on meta tensors) sets a floor on each GPU from its published
bandwidth and peak rate for the dtype (data/gpu_specs.yaml):

    floor(gpu) = max(bytes / bandwidth(gpu), flops / peak(gpu, dtype))

The measured GPU's time over its own floor is how efficient the course's kernel (and PyTorch) is on
that workload; the prediction assumes the same efficiency on the other GPU:

    predicted_us(gpu) = measured_us(basis) * floor(gpu) / floor(basis)

The basis is the H200's row where the lab has one, else the H100's; the other of the two is
predicted where the lab has no row of it measured. A GPU with a measured row is never predicted,
and a configuration whose bytes do not fit in a GPU's memory gets no row there. A workload far
from its floor on the basis (latency, extra passes) is noted as rough.
Every row says "predicted, not measured" and names its basis (data/expected/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grading import devices, expected  # noqa: E402 - the repository's modules, from a script
from grading.labs import LAB_MODULES, get_lab  # noqa: E402
from grading.spec import Case  # noqa: E402

# The GPUs students bring that no row of this repository was measured on (keys of gpu_specs.yaml).
PREDICTED_GPUS = (
    "a100-sxm4-80gb",
    "a100-80gb-pcie",
    "a10",
    "l4",
    "geforce-rtx-4090",
    "tesla-t4",
    "b200",
)
# Measured GPUs whose efficiency is carried over, the first that has a row.
BASES = ("h200", "h100-80gb-hbm3")
# Below this fraction of its floor on the basis, a workload's time is mostly something other than
# bytes and flops (launch latency, synchronization, extra passes), which need not scale with the
# floors: its row says the prediction is rough.
FAR_FROM_FLOOR = 0.25


def workloads(lab_id: str) -> dict[str, tuple[float | None, float | None, torch.dtype]]:
    """{config id: (bytes, flops, dtype)} of the lab's timed configurations; bytes and flops are
    None where the inputs cannot be made on meta tensors (a routing step that needs values)."""
    found = {}
    for fn in get_lab(lab_id).functions:
        for config in fn.perf:
            case = Case(config.shape, config.dtype, params=config.params)
            try:
                inputs = fn.make_inputs(case.shape, case.dtype, "meta", None)
            except NotImplementedError:
                found[config.id] = (None, None, config.dtype)
                continue
            flops = fn.flops(*inputs, **case.kwargs) if fn.flops else 0.0
            found[config.id] = (float(fn.bytes_moved(*inputs, **case.kwargs)), flops, config.dtype)
    return found


def floor_us(gpu: str, nbytes: float, flops: float | None, dtype: torch.dtype) -> float:
    row = devices.spec(gpu)
    compute = (flops or 0.0) / (devices.peak_tflops(gpu, dtype) * 1e6)
    return max(nbytes / (row["bandwidth_gbps"] * 1e3), compute)


def predict_entry(gpu: str, basis_slug: str, basis: dict, work: dict) -> dict:
    configs = {}
    for config_id, row in basis["configs"].items():
        nbytes, flops, dtype = work.get(config_id, (None, None, torch.float32))
        # bytes the spec could not count on meta tensors: from the basis's own GB/s
        nbytes = nbytes or row["reference_gbps"] * row["reference_us"] * 1e3
        if nbytes > devices.spec(gpu)["memory_gb"] * 1e9:
            continue
        basis_floor = floor_us(basis_slug, nbytes, flops, dtype)
        scale = floor_us(gpu, nbytes, flops, dtype) / basis_floor
        reference = row["reference_us"] * scale
        notes = [] if flops is not None else ["bytes only: the flops were not counted"]
        efficiency = basis_floor / row["reference_us"]
        if efficiency < FAR_FROM_FLOOR:
            notes.append(f"rough: {efficiency:.0%} of the floor on the basis (too slow where "
                         "launch latency dominates)")  # fmt: skip
        configs[config_id] = {
            "reference_us": round(reference, 2),
            "reference_gbps": round(nbytes / (reference * 1e3), 1),
            "torch_us": None if row.get("torch_us") is None else round(row["torch_us"] * scale, 2),
            "target_us": round(reference / expected.TARGET, 2),
            "excellent_us": round(reference / expected.EXCELLENT, 2),
        }
        if notes:
            configs[config_id]["note"] = "; ".join(notes)
    return {
        "gpu": devices.spec(gpu)["name"],
        "status": expected.PREDICTED,
        "basis": {"gpu": basis["gpu"], "source": basis.get("source")},
        "formula": "measured_us(basis) * floor(gpu) / floor(basis): data/expected/README.md",
        "configs": configs,
    }


def predict_lab(lab_id: str, gpus: tuple[str, ...]) -> dict | None:
    """The lab's predicted table, or None where no basis GPU has a measured row."""
    measured_path = expected.path(lab_id)
    if not measured_path.exists():
        return None
    measured = yaml.safe_load(measured_path.read_text()) or {}
    rows = measured.get("gpus") or {}
    basis_slug = next((slug for slug in BASES if slug in rows), None)
    if basis_slug is None:
        return None
    work = workloads(lab_id)
    unmeasured_bases = tuple(slug for slug in BASES if slug not in gpus)
    predicted = {
        gpu: predict_entry(gpu, basis_slug, rows[basis_slug], work)
        for gpu in (*gpus, *unmeasured_bases)
        if gpu not in rows
    }
    return {
        "lab": lab_id,
        "title": measured.get("title"),
        "status": expected.PREDICTED,
        "gpus": predicted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(PREDICTED_GPUS))
    args = parser.parse_args()
    gpus = tuple(g for g in args.gpus.split(",") if g)
    unknown = [g for g in gpus if devices.spec(g) is None]
    if unknown:
        parser.error(f"not in {devices.SPECS_PATH.name}: {', '.join(unknown)}")
    for lab_id in LAB_MODULES:
        table = predict_lab(lab_id, gpus)
        if table is None:
            print(f"{lab_id}: no measured row to predict from")
            continue
        out = expected.path(lab_id, expected.PREDICTED_DIR)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(table, sort_keys=False, width=110))
        print(f"{lab_id}: {', '.join(table['gpus'])} -> {out.relative_to(expected.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
