"""Triton's own profiler, proton (`triton.profiler`), on the lab's two transposes, and its output
read back.

Proton times every Triton kernel launched inside a session through CUPTI, grouped by the `scope`s
you open, and adds the bytes and flops a kernel declares (`@triton.jit(launch_metadata=...)`, as
`kernels.profiling.transpose` does), so it prints GB/s per kernel without a line of timing code:

    python -m kernels.profiling.proton OUT_STEM     # writes OUT_STEM.hatchet (GPU only)
    proton-viewer -m time/us,gbyte/s OUT_STEM.hatchet

The .hatchet file is JSON: a tree of frames (scopes, then kernels) with their metrics.
`read_hatchet`
flattens it into rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kernels import runtime


def run(stem: str, calls: int = 20) -> Path:
    """Profile `calls` calls of each transpose at the lab's size, one scope each; return the
    file."""
    import triton.profiler as proton

    from kernels.profiling import transpose, workloads

    x = torch.randn(workloads.TRANSPOSE, device=runtime.DEVICE, dtype=torch.bfloat16)
    out = torch.empty(workloads.TRANSPOSE[::-1], device=runtime.DEVICE, dtype=torch.bfloat16)
    for fn in (transpose.transpose_naive, transpose.transpose_tiled):
        fn(x, out)  # compile outside the session
    torch.cuda.synchronize()
    proton.start(stem, hook="triton")
    for name, fn in (("naive", transpose.transpose_naive), ("tiled", transpose.transpose_tiled)):
        with proton.scope(name):
            for _ in range(calls):
                fn(x, out)
    torch.cuda.synchronize()
    proton.finalize()
    return Path(f"{stem}.hatchet")


def read_hatchet(path) -> list[dict]:
    """Every frame of the tree as {"path": "ROOT/tiled/transpose_tiled_kernel ...", "name", "depth",
    **metrics}, parents before their children."""
    data = json.loads(Path(path).read_text())
    roots = data if isinstance(data, list) else [data]
    rows = []

    def walk(node, parents):
        name = node.get("frame", {}).get("name", "?")
        here = [*parents, name]
        rows.append(
            {
                "path": "/".join(here),
                "name": name,
                "depth": len(parents),
                **{k: v for k, v in node.get("metrics", {}).items()},
            }
        )
        for child in node.get("children", []):
            walk(child, here)

    for root in roots:
        if isinstance(root, dict) and "frame" in root:
            walk(root, [])
    return rows


def kernel_rows(rows: list[dict]) -> list[dict]:
    """The leaves (kernels) with their time per call in microseconds and, where declared, GB/s."""
    parents = {r["path"].rsplit("/", 1)[0] for r in rows if "/" in r["path"]}
    out = []
    for r in rows:
        if r["path"] in parents or r["depth"] == 0:
            continue
        count = r.get("count", 0) or 0
        ns = r.get("time (ns)", 0.0) or 0.0
        row = {
            "scope": r["path"].split("/")[1] if r["depth"] > 1 else "",
            "kernel": r["name"],
            "calls": count,
            "us_per_call": ns / count / 1e3 if count else None,
        }
        if r.get("bytes") and ns:
            row["gbps"] = r["bytes"] / ns  # bytes per nanosecond = GB/s
        out.append(row)
    return out


if __name__ == "__main__":
    if not runtime.ON_GPU:
        sys.exit("proton needs a GPU")
    print(run(sys.argv[1] if len(sys.argv) > 1 else "proton"))
