"""Show a result together with the machine it came from.

Every notebook shows its measurements through this module, so that no number appears without
the GPU it was measured on. On a GPU a measurement is taken on the GPU in hand; without one, the
notebook shows the committed run of a GPU it names (the run its own outputs came from), and
says so:

    run = results.Run("02_rmsnorm", gpu="h100-80gb-hbm3", by="python -m kernels.rmsnorm.benchmark")
    fwd, copy_gbps, where = run.show("forward", benchmark.forward)
    # GPU:  benchmark.forward() runs now; where = "measured here: NVIDIA H100 80GB HBM3"
    # CPU:  the "forward" section of data/results/h100-80gb-hbm3/02_rmsnorm.json, and
    #       where = "recorded on a GPU, not this machine: NVIDIA H100 80GB HBM3, 2026-11-24, ..."

    saved, where = run.recorded()  # the benchmark's own committed run, for cells that show it

A committed run is one JSON file `data/results/<gpu>/<name>.json`, written by a topic's
benchmark module, with the environment fingerprint of `kernels.runtime` under "fingerprint".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import bench, runtime

RESULTS_DIR = Path(__file__).resolve().parents[1] / "data" / "results"


def describe(fingerprint: dict, here: bool, by: str) -> str:
    """One line naming where a recorded run was measured, and with what software."""
    fp = fingerprint
    machine = "this GPU model" if here else "a GPU, not this machine"
    return (
        f"recorded on {machine}: {fp.get('gpu')}, {str(fp.get('date'))[:10]}, "
        f"driver {fp.get('driver')}, CUDA {fp.get('cuda')}, torch {fp.get('torch')}, "
        f"triton {fp.get('triton')}, cupy {fp.get('cupy')}, by `{by}`"
    )


class Run:
    """The results of one benchmark module (`name`, written by the command `by`), and the GPU
    whose committed run stands in for a measurement where there is no GPU (`gpu`: a folder of
    `data/results/`)."""

    def __init__(self, name: str, gpu: str, by: str):
        if not (RESULTS_DIR / gpu).is_dir():
            known = sorted(p.name for p in RESULTS_DIR.iterdir() if p.is_dir())
            raise ValueError(
                f"no committed runs for GPU {gpu!r} in {RESULTS_DIR}: the folders there are {known}"
            )
        self.name, self.gpu, self.by = name, gpu, by

    def path(self) -> Path:
        """This GPU model's committed run if there is one (GPU mode), else the named GPU's."""
        if runtime.ON_GPU:
            own = RESULTS_DIR / runtime.gpu_info().slug / f"{self.name}.json"
            if own.is_file():
                return own
        return RESULTS_DIR / self.gpu / f"{self.name}.json"

    def recorded(self) -> tuple[dict | None, str]:
        """(the committed results, the line saying where they were measured), or (None, why not)."""
        path = self.path()
        if not path.is_file():
            shown = path.relative_to(RESULTS_DIR.parents[1])
            return None, f"no recorded GPU results: {shown} does not exist (run `{self.by}`)"
        saved = json.loads(path.read_text())
        fp = saved.get("fingerprint", {})
        here = runtime.ON_GPU and fp.get("gpu") == runtime.gpu_info().name
        return saved, describe(fp, here, self.by)

    def show(
        self, section: str | tuple[str, ...], measure: Callable[[], Any], needs: str | None = None
    ) -> tuple[Any, float | None, str | None]:
        """(result, the copy GB/s it is judged against, where): `measure()` on a GPU; without one,
        the committed run's `section` (a tuple of sections gives a dict of them) and its copy
        bandwidth (None if it measured none), or three Nones when there is no committed run.
        `needs`: a feature of runtime.FEATURE_GPUS the measurement uses; on a GPU without it the
        committed run stands in too, and a line says why."""
        if runtime.ON_GPU and (needs is None or runtime.has(needs)):
            where = f"measured here: {runtime.gpu_info().name}"
            return measure(), bench.ceilings()["copy_gbps"], where
        if runtime.ON_GPU:
            found = runtime.features()
            print(
                f"This {found.name} ({found.arch}) has no {needs}, which this measurement uses: "
                f"showing a committed run instead ({needs} runs on {runtime.FEATURE_GPUS[needs]})."
            )
        saved, where = self.recorded()
        if saved is None:
            print(bench.NOT_MEASURED, f"({where})")
            return None, None, None
        copy_gbps = saved.get("ceilings", {}).get("copy_gbps")  # None where the run measured none
        if isinstance(section, tuple):
            return {s: saved[s] for s in section}, copy_gbps, where
        return saved[section], copy_gbps, where

    def ceilings(self) -> tuple[dict | None, str | None]:
        """(copy GB/s and bf16 matmul TFLOP/s, where): measured on this GPU, or the committed
        run's."""
        if runtime.ON_GPU:
            return bench.ceilings(), f"measured on this {runtime.gpu_info().name}"
        saved, where = self.recorded()
        if not saved or "ceilings" not in saved:
            return None, None
        return saved["ceilings"], where


class OpLog(TorchDispatchMode):
    """Records every ATen op run inside the `with` block: its name, the shape of its first
    output, and the megabytes of its tensor inputs and outputs. On the meta device nothing is
    computed, so a full-size call shows its traffic at once."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        first = outs[0] if outs else None
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ""
        self.rows.append(
            {
                "op": str(func).removeprefix("aten."),
                "output shape": shape,
                "MB read": _megabytes(args),
                "MB written": _megabytes(outs),
            }
        )
        return out


def _megabytes(values) -> float:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, torch.Tensor)) / 1e6
