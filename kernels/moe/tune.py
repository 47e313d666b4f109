"""Choosing the large-batch grouped GEMM's configuration per token bucket by a greedy search whose
candidates are timed interleaved, and keeping the choices per GPU model in
kernels/moe/tuned/<gpu>.json.

Why not leave it to the autotuner. Triton's autotuner times one configuration after another, a few
repetitions each. At 32768 tokens the layer holds an H100 at its 700 W power limit, and the SM clock
wanders between 1300 and 1980 MHz
(`data/results/h100-80gb-hbm3/explore/06_moe_layer_configs.clocks.csv`): one 17 ms product varies by
7% between its 10th and 90th percentile, more than the configurations differ. In two runs the
autotuner chose gate_up's tile flattened with GROUP_M 16, then not flattened with GROUP_M 8, and the
layer went from 93.9% to 91.3% of dense cuBLAS, while in the second run the same layer with GROUP_M
pinned at 4 ran at 95.8% (`06_moe_layer_pinned.log`, in the same folder). `bench.benchmark`
interleaves the candidates (A, B, C, A, B, C, ...), so the clock's wandering falls on each of them
alike.

The search is greedy, one parameter at a time: first every tile at GROUP_M 8,
interleaved; then GROUP_M 4, 8 and 16 on the winning tile, interleaved again (8 included, so the
final comparison is within one run). At most eight timed candidates instead of eighteen. Each
candidate's output is checked against the pointer kernel's before it is timed. Tuned: the products
of the layer's large-batch variant at each token count of TOKENS, the benchmark's configuration (32
experts, top-2, hidden 4096, intermediate 11008, bf16). Every candidate's median is written beside
the choice, so a reader sees the margins. Buckets the table lacks (another shape, another GPU) fall
back to the autotuner.

    python -m kernels.moe.tune      # on the GPU, ~2 minutes; writes kernels/moe/tuned/<gpu>.json
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Callable

import torch
import triton

from kernels import bench, runtime
from kernels.moe import moe_layer, reference, triton_grouped_gemm, triton_permute, triton_router
from kernels.moe import triton_grouped_gemm_tma as tma
from kernels.moe.benchmark import DTYPE, EXPERTS, HIDDEN, INTER, TOP_K, rel_err
from kernels.testing import generator

# token buckets 128 ... 2048: every one the large-batch variant serves
TOKENS = (4096, 8192, 16384, 32768, 65536)
TARGET_MS = 3000.0  # per interleaved run: 15-100 rounds, depending on the size


def greedy_search(
    time_configs: Callable[[list[triton.Config]], dict[str, float]],
    fits: Callable[[triton.Config], bool],
) -> tuple[triton.Config, dict[str, dict[str, float]]]:
    """The configuration to keep, and each stage's medians in ms (`time_configs`, interleaved)."""
    first, *others = tma.GROUP_M_CHOICES
    tiles = [c for c in (tma.tile_config(*tile, first) for tile in tma.GPU_TILES) if fits(c)]
    if not tiles:
        raise ValueError("greedy_search: no tile fits this launch")
    stage_1 = time_configs(tiles)
    best = min(tiles, key=lambda c: stage_1[tma.config_name(c)])
    tile = (
        best.kwargs["BLOCK_N"],
        best.kwargs["BLOCK_K"],
        best.num_warps,
        best.num_stages,
        best.kwargs["FLATTEN"],
    )
    groups = [best] + [c for c in (tma.tile_config(*tile, g) for g in others) if fits(c)]
    stage_2 = time_configs(groups)
    best = min(groups, key=lambda c: stage_2[tma.config_name(c)])
    return best, {"stage 1 ms": stage_1, "stage 2 ms": stage_2}


def tune_layer_products(tokens: int, w: reference.MoEWeights, variant: str) -> dict[str, dict]:
    """Table entries for `variant`'s gate_up and down at `tokens`, routing random tokens."""
    options = tma.VARIANTS[variant]
    g = generator(tokens, runtime.DEVICE)
    x = torch.randn(tokens, HIDDEN, device=runtime.DEVICE, generator=g).to(DTYPE)
    _, ids, _ = triton_router.route(x, w.router, TOP_K)
    perm = triton_permute.permute(
        ids, EXPERTS, triton_grouped_gemm.block_m_for(tokens, EXPERTS, TOP_K)
    )
    used = (perm.sorted_ids >= 0).nonzero().flatten()
    # the pointer kernel's: the reference
    h = triton_grouped_gemm.gate_up_swiglu(x, w.gate, w.up, perm)
    products = {
        "gate_up": (
            functools.partial(tma.gate_up_swiglu, x, w.gate, w.up, perm, variant=variant),
            h,
            dict(
                n=INTER,
                k=HIDDEN,
                swiglu=True,
                gather=not options["pregather"],
                interleaved=options["interleave"],
            ),
        ),
        "down": (
            functools.partial(tma.down, h, w.down, perm, variant=variant),
            triton_grouped_gemm.down(h, w.down, perm),
            dict(n=HIDDEN, k=INTER, swiglu=False, gather=False, interleaved=False),
        ),
    }
    entries = {}
    for product, (launch, expected, shape) in products.items():

        def fits(c, swiglu=shape["swiglu"]):
            return tma.fits(
                c, block_m=perm.block_m, swiglu=swiglu, persistent=options["persistent"]
            )

        def time_configs(configs, launch=launch, expected=expected):
            # correct first: a configuration that computes something else is not timed
            for c in configs:
                err = rel_err(launch(config=c)[used], expected[used])
                if not err <= 1e-2:  # NaN fails too
                    raise AssertionError(
                        f"{product} with {tma.config_name(c)}: relative error {err} against "
                        f"the pointer kernel at {tokens} tokens"
                    )
            fns = {tma.config_name(c): functools.partial(launch, config=c) for c in configs}
            return {
                name: t.median_us / 1e3
                for name, t in bench.benchmark(fns, target_ms=TARGET_MS).items()
            }

        best, stages = greedy_search(time_configs, fits)
        key = tma.tuning_key(
            triton_grouped_gemm.token_bucket(perm.max_tiles),
            shape["n"],
            shape["k"],
            swiglu=shape["swiglu"],
            gather=shape["gather"],
            persistent=options["persistent"],
            interleaved=shape["interleaved"],
        )
        entries[key] = {
            "config": tma.config_name(best),
            "tokens": tokens,
            "product": product,
            **stages,
        }
        print(f"{tokens:6d} {product:8s} chose {tma.config_name(best)}", flush=True)
        for (
            stage,
            times,
        ) in stages.items():  # each stage is one interleaved run: compare within a stage only
            print(
                f"    {stage}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in times.items()),
                flush=True,
            )
    return entries


def main() -> int:
    if not runtime.ON_GPU:
        print(bench.NOT_MEASURED)
        return 1
    variant = moe_layer.LARGE_BATCH_VARIANT
    triton_grouped_gemm.TUNING_OVERRIDE = (
        0  # the pointer kernel only gives the reference outputs: not tuned here
    )
    w = reference.init_weights(EXPERTS, HIDDEN, INTER, DTYPE, "cuda", generator(0, "cuda"))
    entries = {}
    for tokens in TOKENS:
        assert moe_layer.grouped_gemm_for(tokens, EXPERTS, TOP_K) == variant, tokens
        entries.update(tune_layer_products(tokens, w, variant))
    path = tma.TUNED_DIR / f"{runtime.gpu_info().slug}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "fingerprint": runtime.fingerprint(),
                "variant": variant,
                "written_by": "python -m kernels.moe.tune",
                "entries": entries,
            },
            indent=1,
        )
    )
    tma.load_tuned(path)  # what was written reads back
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
