"""The anchors table of notebooks/README.md, written from the committed runs in data/results/.

    python tools/anchors.py           # print the table
    python tools/anchors.py --write   # replace the table between its markers in notebooks/README.md

An anchor is what PyTorch, cuBLAS or cuDNN did on a GPU before the course's kernels ran: the copy
bandwidth, the dense bf16 matmul rate, F.rms_norm, SDPA, the MoE baselines. Each benchmark module
measures the ones it needs in its own run, so a number here is read from those runs, never typed;
where several runs measured it (the ceilings), the table gives their range.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kernels.results import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "notebooks" / "README.md"
BEGIN, END = "<!-- anchors: begin -->", "<!-- anchors: end -->"
# The GPUs of the table: a folder of data/results/ each, and the column's title.
GPUS = {"h200": "H200", "h100-80gb-hbm3": "H100 80GB HBM3"}
NOT_RECORDED = "not recorded"


def _runs(gpu: str) -> dict[str, dict]:
    """Every benchmark module's committed run for `gpu`, by module name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((RESULTS_DIR / gpu).glob("*.json"))}


def _span(values: list[float], unit: str) -> str:
    if not values:
        return NOT_RECORDED
    low, high = round(min(values)), round(max(values))
    return f"{low} {unit}" if low == high else f"{low}–{high} {unit}"


def _attention(run: dict | None, impl: str) -> str:
    """`impl`'s forward TFLOP/s at the two course shapes, fp16, no mask."""
    if not run:
        return NOT_RECORDED
    rates = []
    for shape in ([16, 16, 2048, 64], [32, 32, 4096, 128]):
        row = next(
            t
            for t in run["targets"]
            if t["shape"] == shape and t["dtype"] == "float16" and not t["causal"]
        )
        rates.append(f"{row['impls'][impl]['fwd_tflops']:.0f}")
    return " / ".join(rates) + " TFLOP/s"


def _moe(run: dict | None, column: str) -> str:
    """`column` (ms) of the MoE layer at 2048, 8192 and 32768 balanced tokens."""
    if not run:
        return NOT_RECORDED
    rows = {r["tokens"]: r for r in run["layer"] if not r["skewed"]}
    return " / ".join(f"{rows[t][column]:.1f}" for t in (2048, 8192, 32768)) + " ms"


def _column(gpu: str) -> list[str]:
    runs = _runs(gpu)
    ceilings = [r["ceilings"] for r in runs.values() if "ceilings" in r]
    add = runs.get("01_elementwise_add")
    torch_add = (
        next(
            (t["gbps"] for t in add["targets"] if t["target"].startswith("add torch float16")), None
        )
        if add
        else None
    )
    rmsnorm = runs.get("02_rmsnorm")
    rms = rmsnorm["forward"]["F.rms_norm"]["gbps"] if rmsnorm else None
    copy = rmsnorm["ceilings"]["copy_gbps"] if rmsnorm else None
    return [
        _span([c["copy_gbps"] for c in ceilings], "GB/s"),
        _span([c["matmul_bf16_tflops"] for c in ceilings], "TFLOP/s"),
        f"{torch_add:.0f} GB/s" if torch_add else NOT_RECORDED,
        f"{rms:.0f} GB/s ({100 * rms / copy:.0f}% of copy)" if rms else NOT_RECORDED,
        _attention(runs.get("03_flash_attention"), "sdpa flash"),
        _attention(runs.get("03_flash_attention"), "sdpa cudnn"),
        _moe(runs.get("06_moe"), "naive ms"),
        _moe(runs.get("06_moe"), "grouped_mm ms"),
    ]


ROWS = (
    "copy bandwidth (bytes read + written), across the module runs",
    "dense bf16 matmul, cuBLAS 8192³, across the module runs",
    "`torch.add`, 64M fp16 elements",
    "`F.rms_norm`, 32768 × 4096 bf16",
    "SDPA FlashAttention-2 forward, (16,16,2048,64) / (32,32,4096,128) fp16",
    "SDPA cuDNN attention forward, same shapes",
    "MoE layer (32 experts, top-2, 4096 → 11008 SwiGLU, bf16), naive loop, "
    "2048 / 8192 / 32768 tokens",
    "same, `torch._grouped_mm`",
)


def table() -> str:
    """The anchors as a Markdown table, one column per GPU of GPUS."""
    columns = [_column(gpu) for gpu in GPUS]
    lines = ["| | " + " | ".join(GPUS.values()) + " |", "|---" * (len(GPUS) + 1) + "|"]
    for i, name in enumerate(ROWS):
        lines.append(f"| {name} | " + " | ".join(col[i] for col in columns) + " |")
    sources = ", ".join(f"`data/results/{gpu}/`" for gpu in GPUS)
    return "\n".join(lines) + f"\n\nSources: the benchmark runs in {sources}."


def committed_table(readme: str) -> str:
    """The table as notebooks/README.md has it, between its markers."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write it into notebooks/README.md")
    args = parser.parse_args(argv)
    text = table()
    if not args.write:
        print(text)
        return 0
    readme = README.read_text()
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + text + "\n" + readme[end:])
    print(f"wrote the anchors table into {README.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
