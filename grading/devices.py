"""Published bandwidth and peak rates of the GPUs students bring (data/gpu_specs.yaml).

Two questions are asked of it:

* `peak_tflops(gpu, dtype)`: the rate a kernel computing in `dtype` can reach on that GPU, for the
  predicted rows of the expected tables. A dtype without tensor cores there runs on the CUDA cores
  (bf16 on a T4: its fp32 rate).
* `fastest_tflops(gpu, dtype)`: the fastest rate at which that GPU can compute a `dtype` product in
  any format that holds it exactly (bf16 in fp16 tensor cores, fp32 in tf32, fp16 accumulation on a
  GeForce card), for the "faster than the hardware floor" rule, which must never catch an honest
  kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import yaml

SPECS_PATH = Path(__file__).resolve().parents[1] / "data" / "gpu_specs.yaml"

# dtype -> its name in the table's rates
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}
# The formats that hold a dtype's products exactly enough for a kernel to compute them there.
HOLDS = {"fp32": ("fp32", "tf32"), "fp16": ("fp16",), "bf16": ("bf16", "fp16"),
         "fp8": ("fp8", "fp16", "bf16")}  # fmt: skip


@functools.cache
def table() -> dict[str, dict]:
    """{gpu slug: its row of data/gpu_specs.yaml}."""
    return yaml.safe_load(SPECS_PATH.read_text())["gpus"]


def spec(gpu_slug: str | None) -> dict | None:
    return table().get(gpu_slug) if gpu_slug else None


def dtype_name(dtype: torch.dtype | str) -> str | None:
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype)


def peak_tflops(gpu_slug: str, dtype: torch.dtype | str) -> float | None:
    """Dense tensor-core TFLOP/s for `dtype` on this GPU, its CUDA cores' fp32 rate where it has no
    tensor cores for it; None for a GPU not in the table."""
    row = spec(gpu_slug)
    if row is None:
        return None
    rates = row["tflops"]
    return rates.get(dtype_name(dtype)) or rates["fp32"]


def fastest_tflops(gpu_slug: str, dtype: torch.dtype | str) -> float | None:
    """The largest published rate of this GPU in any format that holds `dtype`'s products; None
    for a GPU not in the table."""
    row = spec(gpu_slug)
    if row is None:
        return None
    name = dtype_name(dtype) or "fp32"
    rates = [row["tflops"]["fp32"]]
    for table_name in ("tflops", "tflops_fp16_accumulate"):
        found = row.get(table_name) or {}
        rates += [found[fmt] for fmt in HOLDS.get(name, (name,)) if fmt in found]
    return max(rates)
