"""The communication module on gloo with CPU processes: the ring all-reduce against
`dist.all_reduce`, bucketed data parallelism against single-process training, the sharded optimizer
against the unsharded one, the launcher's failures, and the cost model's formulas.

Each multi-process check runs all its cases in one launch (a forked process group starts in a
fraction of a second), world sizes 2 and 4, tiny tensors, a timeout on everything."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from kernels.communication import cost_model, ddp, launch, ring, ring_pipelined, sharded_optimizer
from kernels.memory_profiling import gpt

# Odd sizes, sizes smaller than the world (empty chunks), not divisible by 2, 3 or 4.
SIZES = (1, 2, 3, 7, 1001, 4099)
CFG = gpt.GPTConfig(vocab=97, max_seq=16, d_model=32, layers=2, heads=4)
BATCH, SEQ = 4, 16


def _ring_against_all_reduce(rank, world, sizes):
    failures = []
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * n + rank)  # different values on every rank
        x = torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (n,), generator=g)
        want_fp64 = x.double()
        dist.all_reduce(want_fp64)
        want = x.clone()
        dist.all_reduce(want)
        got = ring.ring_all_reduce(x.clone())
        averaged = ring.ring_all_reduce(x.clone().view(1, n), average=True).view(n)
        for name, value, ref in (
            ("sum vs dist.all_reduce", got, want),
            ("sum vs float64", got, want_fp64.float()),
            ("average", averaged, (want_fp64 / world).float()),
        ):
            if not torch.allclose(value, ref, rtol=1e-5, atol=1e-5) or value.isnan().any():
                failures.append(f"n={n} {name}: max err {(value - ref).abs().max().item():.3g}")
    try:
        ring.ring_all_reduce(torch.randn(4, 6)[:, ::2])
        failures.append("a non-contiguous view was accepted")
    except ValueError as e:
        assert "contiguous" in str(e)
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_ring_all_reduce_matches_dist_all_reduce(world):
    for failures in launch.run(_ring_against_all_reduce, world, (SIZES,), backend="gloo"):
        assert failures == []


def _pipelined_against_ring(rank, world):
    """The pipelined ring makes the same additions in the same order as ring.py: bit for bit the
    same result, for segments of one element, a few, and one per chunk, in every dtype."""
    failures = []
    for n in (0, 1, 2, 7, 1001, 4099):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            g = torch.Generator().manual_seed(1000 * n + rank)
            x = (torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (n,), generator=g)).to(
                dtype
            )
            want = ring.ring_all_reduce(x.clone())
            for segment_bytes in (1, 100, 2**30) if n < 100 else (1000, 2**30):
                for average in (False, True):
                    got = torch.full_like(x, float("nan")).copy_(x)
                    returned = ring_pipelined.pipelined_ring_all_reduce(
                        got, average=average, segment_bytes=segment_bytes
                    )
                    ref = want / world if average else want
                    if returned is not got or not torch.equal(got, ref):
                        failures.append(f"n={n} {dtype} segment {segment_bytes} average {average}")
    try:
        ring_pipelined.pipelined_ring_all_reduce(torch.randn(4, 6)[:, ::2])
        failures.append("a non-contiguous view was accepted")
    except ValueError as e:
        assert "contiguous" in str(e)
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_ring_equals_the_simple_ring_bit_for_bit(world):
    for failures in launch.run(_pipelined_against_ring, world, (), backend="gloo"):
        assert failures == []


@pytest.mark.parametrize(
    "bucket_mb, overlap",
    [(0.0, True), (0.02, True), (100.0, True), (0.02, False)],
    ids=["per-parameter", "small-buckets", "one-bucket", "after-backward"],
)
def test_data_parallel_matches_single_process_training(bucket_mb, overlap):
    n_params = len(list(gpt.GPT(CFG).parameters()))
    for grad_err, weight_err, buckets, launched in launch.run(
        ddp.against_one_process, 2, (bucket_mb, overlap, 3), backend="gloo"
    ):
        assert grad_err < 1e-5 and weight_err < 1e-5, (grad_err, weight_err)
        if bucket_mb == 0.0:
            assert buckets == n_params
        elif bucket_mb == 100.0:
            assert buckets == 1
        else:
            assert 1 < buckets < n_params
        # with overlap every bucket has started when backward returns; without, none has
        assert launched == ([buckets] * 3 if overlap else [0] * 3)


def test_buckets_hold_consecutive_parameters_up_to_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 100, 200, 50, 1000)]
    buckets = ddp.make_buckets(params, bucket_mb=1200 / 2**20)  # 1200 bytes = 300 floats
    assert [[p.numel() for p in b] for b in buckets] == [[300], [100, 200], [50, 1000]]
    assert len(ddp.make_buckets(params, 0.0)) == len(params)


def _sharded_against_full(rank, world, steps):
    torch.manual_seed(0)
    model = gpt.GPT(CFG)
    full_model = copy.deepcopy(model)
    sharded = sharded_optimizer.ShardedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1
    )
    full = torch.optim.AdamW(full_model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        idx, targets = gpt.make_batch(CFG, BATCH, SEQ, "cpu", seed=step)
        for m, opt in ((model, sharded), (full_model, full)):
            m(idx, targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    err = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), full_model.parameters())
    )
    return err, sharded.state_bytes(), sharded_optimizer.state_bytes(full)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_optimizer_equals_unsharded_with_a_share_of_the_state(world):
    results = launch.run(_sharded_against_full, world, (4,), backend="gloo")
    full = results[0][2]
    shards = [r[1] for r in results]
    for err, _, _ in results:
        assert err < 1e-6  # the owner's step is AdamW's own step; the others copy its result
    # every parameter's state is held by exactly one rank (the step counters too)
    assert sum(shards) == full
    assert max(shards) <= 1.15 * full / world, (shards, full)


def _raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _waits_forever(rank, world):
    dist.recv(torch.empty(1), src=1 - rank)  # each waits for the other, neither sends
    return rank


def test_spawned_ranks_run_the_ring_as_nccl_ranks_would():
    """NCCL ranks are spawned, not forked (CUDA does not survive a fork): the same path, on gloo."""
    results = launch.run(
        _ring_against_all_reduce, 2, ((7, 1001),), backend="gloo", start_method="spawn"
    )
    assert results == [[], []]


def test_a_notebook_worker_is_forked_even_after_cuda_was_used(monkeypatch):
    """On an H200, notebook 08's ring cells (workers defined in the notebook, CUDA used by an
    earlier cell) failed with 'exited with code None': the ranks were spawned and could not import
    their worker. A worker of __main__ is forked (its ranks compute on the CPU); one in a module is
    spawned on a GPU machine (there a forked rank's torch.optim step failed with 'CUDA error:
    initialization error'); and spawning a notebook worker is refused with the reason."""
    methods = []
    real_context = launch.mp.get_context
    monkeypatch.setattr(launch.mp, "get_context", lambda m: methods.append(m) or real_context(m))
    # the H200's state in that test process: a GPU, and torch's CUDA not initialized yet
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch.torch.cuda, "is_initialized", lambda: False)

    def in_a_notebook(rank, world):
        return rank

    in_a_notebook.__module__ = "__main__"
    assert launch.run(in_a_notebook, 2, backend="gloo") == [0, 1]
    assert launch.run(_returns_its_rank, 2, backend="gloo") == [0, 1]
    assert methods == ["fork", "spawn"]
    assert launch.importable(_returns_its_rank) and not launch.importable(in_a_notebook)
    with pytest.raises(ValueError, match="in_a_notebook.*defined in a notebook.*a .py file"):
        launch.run(in_a_notebook, 2, backend="gloo", start_method="spawn")


def _returns_its_rank(rank, world):
    return rank


def test_launch_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*rank one is broken"):
        launch.run(_raises, 2, backend="gloo")


def test_launch_stops_a_rank_that_waits_forever():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 3 s"):
        launch.run(_waits_forever, 2, backend="gloo", timeout_s=3)


def test_cost_model_formulas():
    S = 64 * 2**20
    assert cost_model.ring_bytes_per_rank(S, 2) == S
    assert cost_model.ring_bytes_per_rank(S, 8) == 2 * 7 / 8 * S
    assert cost_model.tree_bytes_per_rank(S, 8) == 3 * S
    assert cost_model.tree_bytes_per_rank(S, 5) == 3 * S  # ceil(log2 5) levels
    alpha, beta = 5e-6, 100e9
    assert math.isclose(cost_model.ring_time(S, 4, alpha, beta), 6 * alpha + 1.5 * S / beta)
    assert math.isclose(cost_model.tree_time(S, 4, alpha, beta), 4 * (alpha + S / beta))
    # small messages: the tree's few steps win; large ones: the ring's few bytes win
    assert cost_model.tree_time(8, 64, alpha, beta) < cost_model.ring_time(8, 64, alpha, beta)
    assert cost_model.ring_time(S, 64, alpha, beta) < cost_model.tree_time(S, 64, alpha, beta)
    # an ideal ring's bus bandwidth is the link's
    t = cost_model.ring_time(S, 4, 0.0, beta)
    assert math.isclose(cost_model.bus_bandwidth(S, 4, t), beta)


def test_alpha_beta_fit_recovers_the_line():
    sizes = [4, 1e3, 1e5, 1e6, 4e6]
    alpha, beta = cost_model.fit_alpha_beta(sizes, [20e-6 + m / 2e9 for m in sizes])
    assert math.isclose(alpha, 20e-6, rel_tol=1e-6) and math.isclose(beta, 2e9, rel_tol=1e-6)


def test_overlap_model_exposes_the_last_bucket_at_least():
    alpha, beta, world = 0.0, 1e9, 2
    one = cost_model.overlap([4e6], backward_s=0.1, world=world, alpha_s=alpha, beta_bps=beta)
    assert one.exposed_s == pytest.approx(one.comm_s) and one.hidden_fraction == pytest.approx(0)
    many = cost_model.overlap([1e6] * 4, 0.1, world, alpha, beta)
    last = cost_model.ring_time(1e6, world, alpha, beta)
    assert many.exposed_s == pytest.approx(last) and many.hidden_fraction == pytest.approx(0.75)
    # communication longer than backward: everything past backward's end is exposed
    slow = cost_model.overlap([1e8] * 4, 0.01, world, alpha, beta)
    assert slow.step_s == pytest.approx(slow.comm_s + 0.01 / 4)
