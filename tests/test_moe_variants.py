"""The TMA / persistent grouped-GEMM variants (moe/triton_grouped_gemm_tma.py) against float64.

The same checks as tests/test_moe.py's grouped-GEMM test, for every variant: skewed routing with an
expert that gets no tokens, 100 tokens (not a multiple of the block), top-1 and top-2, bf16 and
fp16, outputs poisoned. A second shape (hidden 80, intermediate 144) is a multiple of neither
BLOCK_K nor BLOCK_N, so the descriptors' zero fill past K and clipping past N are exercised, and so
is the last weight tile reading the next expert's rows.
"""

import json

import pytest
import torch

from kernels import runtime
from kernels.moe import moe_layer, reference, triton_grouped_gemm_tma, triton_permute, tune
from kernels.testing import generator
from tests import test_moe
from tests.test_moe import (
    DEV,
    DTYPES,
    E,
    check_h,
    check_layer,
    check_y,
    make_problem,
    permuted_rows,
)

# test_moe's fixture, here under the name the tests ask for
poisoned_empty = test_moe.poisoned_empty

# The TMA kernels refuse where TMA does not exist (KERNELS_GPU_PROFILE=a100 on an H200, say); the
# refusal is tested in tests/test_gpu_portability.py.
pytestmark = pytest.mark.skipif(not runtime.has("tma"), reason="no TMA on this GPU or profile")
VARIANTS = list(triton_grouped_gemm_tma.VARIANTS)


@pytest.fixture(autouse=True, scope="module")
def one_variant_config():
    """On the GPU, one configuration per case (the benchmark autotunes and checks at full size)."""
    triton_grouped_gemm_tma.TUNING_OVERRIDE = 0
    yield
    triton_grouped_gemm_tma.TUNING_OVERRIDE = None


def _routed(tokens, top_k, dtype, *, skew, hidden, inter):
    g = generator(0, DEV)
    w = reference.init_weights(E, hidden, inter, dtype, DEV, g)
    x = torch.randn(tokens, hidden, device=DEV, generator=g)
    if skew:  # as tests/test_moe.py: expert 0 takes most tokens, expert 3 none
        x += 0.5
        w.router[0] += 0.1
        w.router[3] -= 0.1
    x = x.to(dtype)
    _, ids, _ = reference.route(x, w.router, top_k, fp64=True)
    perm = triton_permute.permute(ids.to(torch.int32), E, 16)
    if skew:
        assert (perm.counts == 0).any(), "the skewed case must leave an expert without tokens"
    return x, w, perm


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k,skew", [(1, True), (2, False), (2, True)])
@pytest.mark.parametrize("hidden,inter", [(128, 256), (80, 144)])
@pytest.mark.usefixtures("poisoned_empty")
def test_variant_gate_up_and_down(variant, dtype, top_k, skew, hidden, inter):
    x, w, perm = _routed(100, top_k, dtype, skew=skew, hidden=hidden, inter=inter)
    h = triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant)
    check_h(h, x, w, perm, dtype)
    y = triton_grouped_gemm_tma.down(h, w.down, perm, variant=variant)
    check_y(y, h, w, perm, dtype)


def test_interleaved_gate_up_is_prepared_once_and_again_after_a_change():
    """Row 2j is gate's row j and 2j + 1 up's; the same pair gives the same tensor back (no copy per
    call); an in-place update of either weight, or another pair, gives a fresh one with the new
    values."""
    g = generator(0, DEV)
    w = reference.init_weights(E, 80, 144, torch.bfloat16, DEV, g)
    first = triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up)
    assert first.shape == (E, 2 * 144, 80)
    assert torch.equal(first[:, 0::2], w.gate) and torch.equal(first[:, 1::2], w.up)
    assert triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up) is first
    w.up[3, 5] += 1.0
    updated = triton_grouped_gemm_tma.interleaved_gate_up(w.gate, w.up)
    assert updated is not first and torch.equal(updated[:, 1::2], w.up)
    gate_copy = w.gate.clone()
    assert triton_grouped_gemm_tma.interleaved_gate_up(gate_copy, w.up) is not updated


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.usefixtures("poisoned_empty")
def test_gather_rows(top_k):
    x, _, perm = _routed(37, top_k, torch.bfloat16, skew=True, hidden=80, inter=144)
    out = triton_grouped_gemm_tma.gather_rows(x, perm)
    real, token, _, padding = permuted_rows(perm)
    assert torch.equal(out[real], x[token])
    assert (out[padding] == 0).all()


@pytest.mark.parametrize(
    "variant", ["tma", "persistent_pregathered", "persistent_pregathered_interleaved"]
)
@pytest.mark.usefixtures("poisoned_empty")
def test_variant_checks_can_fail(variant):
    """A kernel that skips the last tile in use (the work bound read on the device, one tile short)
    leaves poisoned rows, and weights of the wrong expert give wrong rows: both must fail the
    checks."""
    dtype = torch.bfloat16
    x, w, perm = _routed(100, 2, dtype, skew=False, hidden=128, inter=256)
    perm.padded_offsets[-1] -= perm.block_m
    with pytest.raises(AssertionError):
        check_h(
            triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant),
            x,
            w,
            perm,
            dtype,
        )
    perm.padded_offsets[-1] += perm.block_m
    h = triton_grouped_gemm_tma.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant)
    check_h(h, x, w, perm, dtype)
    swapped = w.down.roll(1, dims=0)
    with pytest.raises(AssertionError):
        check_y(triton_grouped_gemm_tma.down(h, swapped, perm, variant=variant), h, w, perm, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.usefixtures("poisoned_empty")
def test_layer_with_variant(variant, top_k):
    dtype = torch.bfloat16
    x, w = make_problem(37, dtype)
    check_layer(moe_layer.moe_forward(x, w, top_k, grouped_gemm=variant), x, w, top_k, dtype)


def test_variant_by_rows_per_expert():
    """The seed configuration (32 experts, top-2): 2048 tokens (128 rows an expert) keep the fused
    gather, 8192 (512 rows) and more take the persistent TMA kernel on gathered rows, gate and up
    interleaved."""
    assert moe_layer.grouped_gemm_for(2048, 32, 2) == "pointer"
    # 256 rows: the edge
    assert moe_layer.grouped_gemm_for(4096, 32, 2) == "persistent_pregathered_interleaved"
    assert moe_layer.grouped_gemm_for(8192, 32, 2) == "persistent_pregathered_interleaved"


def test_unknown_variant():
    with pytest.raises(ValueError, match="variant"):
        moe_layer.grouped_gemm_functions("wgmma")


# ---- The tuned tables (kernels/moe/tuned/<gpu>.json) and the greedy search that writes them
# (kernels/moe/tune.py)


def _launch_args(**overrides):
    """The pruner's view of a launch: gate_up, interleaved persistent variant, 32768 tokens."""
    args = dict(
        BLOCK_M=128,
        SWIGLU=True,
        PERSISTENT=True,
        TOKEN_BUCKET=1024,
        N=11008,
        K=4096,
        GATHER=False,
        INTERLEAVED=True,
    )
    return {**args, **overrides}


def _key(args):
    return triton_grouped_gemm_tma.tuning_key(
        args["TOKEN_BUCKET"],
        args["N"],
        args["K"],
        swiglu=args["SWIGLU"],
        gather=args["GATHER"],
        persistent=args["PERSISTENT"],
        interleaved=args["INTERLEAVED"],
    )


def _write_table(tmp_path, entries):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": entries}))
    return path


def test_tuned_table_decides_its_key_and_only_its_key(tmp_path, monkeypatch):
    m = triton_grouped_gemm_tma
    offered = [
        m.tile_config(*tile, 8) for tile in m.GPU_TILES
    ]  # what the autotuner would time on the GPU
    args = _launch_args()
    table = m.load_tuned(
        _write_table(tmp_path, {_key(args): {"config": "N128 K64 w8 s4 flatten G4"}})
    )
    monkeypatch.setattr(m, "_tuned_for_this_gpu", lambda: table)
    monkeypatch.setattr(m, "TUNING_OVERRIDE", None)  # this module's fixture sets 0
    kept = m.prune_configs(offered, args)
    assert [m.config_name(c) for c in kept] == ["N128 K64 w8 s4 flatten G4"]
    # another bucket, or the down product, is not in the table: the autotuner's fitting choices
    # remain
    for other in (
        _launch_args(TOKEN_BUCKET=2048),
        _launch_args(SWIGLU=False, INTERLEAVED=False, N=4096, K=11008),
    ):
        assert len(m.prune_configs(offered, other)) > 1
    # the tests' override still wins over the table
    monkeypatch.setattr(m, "TUNING_OVERRIDE", 0)
    assert m.config_name(m.prune_configs(offered, args)[0]) == m.config_name(offered[0])


def test_tuned_choice_that_does_not_fit_the_launch_is_not_used(tmp_path, monkeypatch):
    """A flattened tile for a non-persistent launch (nothing to flatten): autotuning instead."""
    m = triton_grouped_gemm_tma
    args = _launch_args(PERSISTENT=False)
    table = m.load_tuned(
        _write_table(tmp_path, {_key(args): {"config": "N128 K64 w8 s4 flatten G8"}})
    )
    monkeypatch.setattr(m, "_tuned_for_this_gpu", lambda: table)
    monkeypatch.setattr(m, "TUNING_OVERRIDE", None)
    kept = m.prune_configs([m.tile_config(*tile, 8) for tile in m.GPU_TILES], args)
    assert kept and not any(c.kwargs["FLATTEN"] for c in kept)


@pytest.mark.parametrize(
    "content,match",
    [
        (
            '{"entries": {"bucket=1": {"config": "N512 K64 w8 s4 G8"}}}',
            "N512 K64 w8 s4 G8.*not one this kernel offers",
        ),
        ('{"entries": {"bucket=1": "N128 K64 w8 s4 G8"}}', "bucket=1"),
        ('{"fingerprint": {}}', "not a tuned table"),
        ('{"entries": [1, 2]}', "not a tuned table"),
        ("not json", "not a tuned table"),
    ],
)
def test_broken_tuned_table_is_refused_with_its_path(tmp_path, content, match):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        triton_grouped_gemm_tma.load_tuned(path)
    assert str(path) in str(info.value)


def test_committed_tuned_tables_load_and_fit_their_keys():
    """Every table in kernels/moe/tuned/ reads back; each choice fits the launch its key names."""
    m = triton_grouped_gemm_tma
    paths = sorted(m.TUNED_DIR.glob("*.json"))
    assert paths, "no tuned table committed"
    for path in paths:
        table = m.load_tuned(path)
        assert table, path
        for key, c in table.items():
            fields = dict(part.split("=") for part in key.split())
            assert (
                m.tuning_key(
                    int(fields["bucket"]),
                    int(fields["N"]),
                    int(fields["K"]),
                    swiglu=fields["swiglu"] == "1",
                    gather=fields["gather"] == "1",
                    persistent=fields["persistent"] == "1",
                    interleaved=fields["interleaved"] == "1",
                )
                == key
            )
            assert m.fits(
                c,
                block_m=128,
                swiglu=fields["swiglu"] == "1",
                persistent=fields["persistent"] == "1",
            ), key


@pytest.mark.parametrize("name", ["N128 K64 w8 s4 flatten G16", "N256 K64 w8 s3 G4"])
@pytest.mark.usefixtures("poisoned_empty")
def test_explicit_configuration_computes_the_same_products(name):
    """The tuner's path past the autotuner: a named configuration still passes the checks."""
    m = triton_grouped_gemm_tma
    c = {m.config_name(c): c for c in m.candidate_configs()}[name]
    dtype = torch.bfloat16
    x, w, perm = _routed(100, 2, dtype, skew=True, hidden=80, inter=144)
    variant = "persistent_pregathered_interleaved"
    h = m.gate_up_swiglu(x, w.gate, w.up, perm, variant=variant, config=c)
    check_h(h, x, w, perm, dtype)
    check_y(m.down(h, w.down, perm, variant=variant, config=c), h, w, perm, dtype)


def test_explicit_configuration_that_does_not_fit_is_refused():
    m = triton_grouped_gemm_tma
    x, w, perm = _routed(100, 2, torch.bfloat16, skew=False, hidden=80, inter=144)
    flattened = m.tile_config(128, 64, 8, 4, True, 8)
    with pytest.raises(ValueError, match="does not fit"):
        # one tile a program
        m.gate_up_swiglu(x, w.gate, w.up, perm, variant="tma", config=flattened)


def test_greedy_search_picks_the_tile_then_group_m():
    """Stage 1 times every fitting tile at GROUP_M 8; stage 2 the winner with 4 and 16, one run."""
    m = triton_grouped_gemm_tma
    calls = []

    def fake_times(configs):
        calls.append([m.config_name(c) for c in configs])
        # the flattened 256-wide tile is fastest; of its GROUP_M, 16
        return {
            m.config_name(c): (1.0 if c.kwargs["BLOCK_N"] == 256 and c.kwargs["FLATTEN"] else 2.0)
            - 0.01 * c.kwargs["GROUP_M"]
            for c in configs
        }

    not_64_wide = lambda c: c.kwargs["BLOCK_N"] != 64  # noqa: E731 -- a fit rule that drops one tile
    best, stages = tune.greedy_search(fake_times, not_64_wide)
    assert m.config_name(best) == "N256 K64 w8 s3 flatten G16"
    assert len(calls) == 2
    assert len(calls[0]) == len(m.GPU_TILES) - 1 and all(n.endswith(" G8") for n in calls[0])
    assert not any(n.startswith("N64 ") for n in calls[0])
    assert calls[1] == [
        "N256 K64 w8 s3 flatten G8",
        "N256 K64 w8 s3 flatten G4",
        "N256 K64 w8 s3 flatten G16",
    ]
    assert set(stages) == {"stage 1 ms", "stage 2 ms"}


def test_greedy_search_keeps_stage_one_winner_when_group_m_does_not_help():
    m = triton_grouped_gemm_tma
    times = lambda configs: {m.config_name(c): 3.0 - (c.kwargs["GROUP_M"] == 8) for c in configs}  # noqa: E731
    best, _ = tune.greedy_search(times, lambda c: True)
    assert best.kwargs["GROUP_M"] == 8
    with pytest.raises(ValueError, match="no tile fits"):
        tune.greedy_search(times, lambda c: False)
