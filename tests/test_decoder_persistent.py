"""The persistent decode step: its schedule proven free of deadlocks and data races by the
simulator, for every batch 1..32 and every number of programs the wrapper may choose; the kernel
against the decoder's own step (CPU: one program through the interpreter); the watchdog's message
for a counter that never reaches its count; the reading of a traced step (its phases' spans, floors
and waits). GPU: greedy tokens against Hugging Face over 64 steps in
bfloat16 and float32, and against the CUDA-graph step."""

import dataclasses

import pytest
import torch

from kernels import runtime
from kernels.decoder import hf_reference, reference, triton_ops
from kernels.decoder import persistent_schedule as sched
from kernels.decoder.benchmark import decode_bytes
from kernels.decoder.benchmark_persistent import phase_bytes, trace_phases
from kernels.decoder.config import LLAMA_1B, TINY
from kernels.decoder.model import Decoder, DecoderWeights
from kernels.decoder.triton_persistent_step import PersistentStep, WatchdogTimeout

DEVICE = runtime.DEVICE
gpu = pytest.mark.gpu
# The SM counts of the GPUs the course profiles (A100, RTX 4090, H100/H200), one and two programs
# an SM, and small counts that leave most units to a few programs
PROGRAM_COUNTS = (1, 2, 3, 5, 16, 108, 128, 132, 264)
# Llama-3.2-1B's phase sizes with two layers: the counts of every layer are the same
TWO_LAYERS = dataclasses.replace(LLAMA_1B, n_layers=2)


# ------------------------------------------------------------------------------------------------
# The schedule


@pytest.mark.parametrize("config", [TINY, TWO_LAYERS], ids=["tiny", "1b-two-layers"])
def test_schedule_is_free_of_deadlocks_and_races_for_every_batch(config):
    for batch in range(1, 33):
        for programs in PROGRAM_COUNTS:
            phases = sched.schedule(config, batch, programs)
            assert [p.counter for p in phases] == list(range(len(phases)))
            for seed in range(2):
                actions = sched.simulate(phases, programs, seed=seed)
                assert actions >= 2 * len(phases) * programs


def test_every_phase_has_work_and_the_units_cover_the_weights():
    tile = sched.tiling(LLAMA_1B, 1, 132)
    units = sched.phase_units(LLAMA_1B, 1, tile)
    c = LLAMA_1B
    assert units["qkv"] * tile.rows == c.qkv_width
    assert units["gate_up"] * tile.rows == 2 * c.intermediate_size
    assert (units["o"] - 1) * tile.rows < c.hidden_size <= units["o"] * tile.rows
    assert (units["lm_head"] - 1) * tile.rows < c.vocab_size <= units["lm_head"] * tile.rows
    assert units["attention"] == c.n_kv_heads * tile.splits and tile.splits > 1


def test_a_wrong_expected_count_is_a_deadlock():
    phases = sched.schedule(TINY, 3, 4)
    wrong = list(phases)
    counter, count = wrong[5].wait
    wrong[5] = dataclasses.replace(wrong[5], wait=(counter, count + 1))
    with pytest.raises(sched.Deadlock, match=f"on counter {counter} for {count + 1}"):
        sched.simulate(wrong, 4)


def test_a_missing_wait_is_a_data_race():
    phases = sched.schedule(TINY, 2, 4)
    attention = next(i for i, p in enumerate(phases) if p.name == "attention")
    racy = list(phases)
    racy[attention] = dataclasses.replace(racy[attention], wait=None)
    with pytest.raises(sched.DataRace, match="attention .* reads q before qkv"):
        for seed in range(20):  # some interleaving starts attention before every qkv is done
            sched.simulate(racy, 4, seed=seed)


# ------------------------------------------------------------------------------------------------
# The reading of a traced step


@pytest.mark.parametrize("batch, context", [(1, 512), (1, 4096), (8, 512)])
def test_the_phases_bytes_add_up_to_the_steps_floor(batch, context):
    nbytes = phase_bytes(LLAMA_1B, batch, context, torch.bfloat16.itemsize)
    total = sum(nbytes[p.name] for p in sched.schedule(LLAMA_1B, batch, 132))
    assert total == decode_bytes(batch, context)


def test_trace_phases_reads_spans_floors_waits_and_boundaries():
    # two programs; (begin, end) of each phase in us
    trace = {
        "batch": 1,
        "context": 512,
        "phases": ["qkv 0", "attention 0", "qkv 1", "attention 1", "lm_head"],
        "us (program, phase, begin/end)": [
            [(0, 10), (12, 15), (17, 27), (30, 33), (35, 100)],
            [(0, 8), (12, 16), (18, 26), (29, 33), (36, 99)],
        ],
    }
    rows = {r["phase"]: r for r in trace_phases(trace, LLAMA_1B, 4000.0, 2)}
    assert list(rows) == ["qkv", "attention", "lm_head", "counters", "step"]
    qkv, attention, lm_head = rows["qkv"], rows["attention"], rows["lm_head"]
    assert (qkv["times"], qkv["span us"], qkv["step us"]) == (2, 10, 20)
    # 3072 rows x 2048 and the norm's 2048, bf16, at 4000 GB/s
    assert qkv["floor us"] == pytest.approx((3072 * 2048 + 2048) * 2 / 4e6)
    assert qkv["% of floor"] == pytest.approx(10 * qkv["floor us"])
    assert qkv["wait us"] == 2  # layer 1 only: the step's first phase waits for nothing
    assert (attention["span us"], attention["wait us"]) == (4, 3)  # waits (2 + 4) / 2, 3
    assert (lm_head["span us"], lm_head["wait us"]) == (65, 2.5)
    assert rows["counters"]["times"] == 4
    assert (rows["counters"]["span us"], rows["counters"]["step us"]) == (2, 7)  # 2, 1, 2, 2
    assert rows["step"]["step us"] == 100 == sum(r["step us"] for r in list(rows.values())[:-1])
    assert rows["step"]["wait us"] == pytest.approx(3 + 2 + 3 + 2.5)
    floors = qkv["step floor us"] + attention["step floor us"] + lm_head["step floor us"]
    assert rows["step"]["floor us"] == pytest.approx(floors)
    assert rows["step"]["% of floor"] == pytest.approx(floors)  # of a 100 us step


# ------------------------------------------------------------------------------------------------
# The kernel on the CPU: one program, every phase in turn


def prompt(config, batch, n, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, n), generator=g)


# The GEMV phases' loops: one tile of K a unit (the default), K tiles pipelined through shared
# memory, and the same with the sum over K made once a unit (the broadcast path only: batch <= 4);
# then the qkv phase in that loop too, K tiles of 64 (TINY's hidden 96: a whole tile and a half);
# and the attention phase's two products on the tensor cores (TINY's 3 query heads a KV head
# padded to 16 rows; keys in tiles of 16 in the interpreter, so a split's last tile is partial)
PIPELINES = {
    "one-tile-a-unit": {},
    "pipelined-k32": {"pipelined_k": 32},
    "pipelined-k32-deferred": {"pipelined_k": 32, "defer_reduce": True},
    "pipelined-k64-qkv": {"pipelined_k": 64, "pipelined_qkv": True},
    "pipelined-k64-qkv-deferred": {"pipelined_k": 64, "defer_reduce": True, "pipelined_qkv": True},
    "attention-dot": {"attention_dot": True},
}
STEP_CASES = [
    pytest.param(dtype, batch, options, id=f"{name}-{dtype}-{batch}")
    for name, options in PIPELINES.items()
    for dtype, batch in [(torch.float32, 2), (torch.bfloat16, 1), (torch.float32, 5)]
    if batch <= 4 or not options.get("defer_reduce")
]


@pytest.mark.parametrize("dtype, batch, pipeline", STEP_CASES)
def test_step_matches_the_decoders_step(dtype, batch, pipeline):
    """Logits and next tokens of two steps against Decoder.decode_step on the same cache; batch 5
    takes the tl.dot path. Pipelined: K tiles of 32 split every unit of TINY's K (96, 200: 3 and
    7 tiles, the last partial) and a program's units run as one loop, so a unit accumulated over
    the wrong tiles, stored (or, deferred, summed over K) before its last tile or not reset after
    it fails. The new position of the cache is NaN before the step, which must write every
    layer's K (rotated) and V there as the decoder did: a key or value left out, rotated wrongly
    or put in another slot fails."""
    hf = hf_reference.random_llama(TINY, seed=3, dtype=dtype)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=batch, max_seq=24)
    tokens = prompt(TINY, batch, 7).to(DEVICE)
    token = triton_ops.argmax(model.prefill(tokens))
    step = PersistentStep(model, batch, **pipeline)
    step.start(token, model.cache.length)
    for _ in range(2):
        length = model.cache.length
        want = model.decode_step(token)  # writes the same cache position first
        model.cache.length = length
        caches = (model.cache.k, model.cache.v)
        appended = [cache[:, :, :, length].clone() for cache in caches]
        for cache in caches:
            cache[:, :, :, length] = float("nan")
        got_tokens = step.replay().clone()
        model.cache.length += 1
        step.check()
        tolerance = reference.LOGITS_TOLERANCE[dtype]
        for cache, decoders in zip(caches, appended):
            assert reference.logits_error(cache[:, :, :, length], decoders) < tolerance
        assert reference.logits_error(step.logits, want) < tolerance
        assert torch.equal(got_tokens, torch.argmax(step.logits, -1))
        assert int(step.positions[0]) == model.cache.length
        token = got_tokens
    assert int(step.counters.abs().sum()) == 0  # the last program reset them


def test_watchdog_names_the_counter_that_never_filled():
    hf = hf_reference.random_llama(TINY, seed=4)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=8)
    model.prefill(prompt(TINY, 1, 3).to(DEVICE))
    step = PersistentStep(model, 1, spin_limit=50)
    step.start(torch.tensor([5], device=DEVICE), model.cache.length)
    bad = sched.counter_index(TINY.n_layers, 1, "combine")
    step.launch(bad_counter=bad)
    with pytest.raises(WatchdogTimeout, match=f"counter {bad} \\(layer 1, phase combine\\)"):
        step.check()
    assert int(step.status.abs().sum()) == 0  # cleared: the next step runs
    step.start(torch.tensor([5], device=DEVICE), model.cache.length)
    step.replay()
    step.check()


# after the timeout program 0 goes on over buffers nobody wrote (NaN): numpy says so. The CPU path
# only: on a GPU both programs are resident and the wait is met (the GPU's own case is
# test_gpu_watchdog_instead_of_a_hang below).
@pytest.mark.cpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_program_that_never_runs_alongside_is_caught_not_waited_for():
    """The interpreter runs program 1 only after program 0 has finished: program 0's first wait
    can never be met, as on a GPU with more programs than fit. The watchdog ends it."""
    hf = hf_reference.random_llama(TINY, seed=4)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=8)
    model.prefill(prompt(TINY, 1, 3).to(DEVICE))
    step = PersistentStep(model, 1, programs=2, spin_limit=20)
    step.start(torch.tensor([5], device=DEVICE), model.cache.length)
    step.launch()
    with pytest.raises(WatchdogTimeout, match="counter 0 \\(layer 0, phase qkv\\)"):
        step.check()


def test_refusals():
    hf = hf_reference.random_llama(TINY, seed=4)
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=5, max_seq=8)
    with pytest.raises(ValueError, match="batch must be in"):
        PersistentStep(model, 6)
    with pytest.raises(ValueError, match="defer_reduce needs pipelined_k"):
        PersistentStep(model, 1, defer_reduce=True)
    with pytest.raises(ValueError, match="defer_reduce is for the broadcast product"):
        PersistentStep(model, 5, pipelined_k=32, defer_reduce=True)
    with pytest.raises(ValueError, match="pipelined_qkv needs pipelined_k"):
        PersistentStep(model, 1, pipelined_qkv=True)
    step = PersistentStep(model, 1)
    step.start(torch.tensor([TINY.vocab_size], device=DEVICE), 8)
    step.launch()
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        step.check()


# ------------------------------------------------------------------------------------------------
# GPU: greedy decoding against Hugging Face and the CUDA graph


# K tiles of 64: TINY's K (96, 200) in 2 and 4 tiles a unit, the last partial
K64 = {"pipelined_k": 64, "pipeline_stages": 4}
QKV_DEFERRED = K64 | {"defer_reduce": True, "pipelined_qkv": True}
GPU_PIPELINES = {
    "one-tile-a-unit": {},
    "pipelined-k64": K64,
    "pipelined-k64-deferred": K64 | {"defer_reduce": True},
    "pipelined-k64-qkv": K64 | {"pipelined_qkv": True},
    "pipelined-k64-qkv-deferred": QKV_DEFERRED,
    "pipelined-k64-qkv-deferred-attention-dot": QKV_DEFERRED | {"attention_dot": True},
}
GPU_CASES = [
    pytest.param(dtype, batch, options, id=f"{name}-{dtype}-{batch}")
    for name, options in GPU_PIPELINES.items()
    for dtype in [torch.float32, torch.bfloat16]
    for batch in [1, 2, 8]
    if batch <= 4 or not options.get("defer_reduce")
]


@gpu
@pytest.mark.parametrize("dtype, batch, pipeline", GPU_CASES)
def test_gpu_greedy_equals_hf_and_the_graph(dtype, batch, pipeline):
    hf = hf_reference.random_llama(TINY, seed=5, dtype=dtype, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=batch, max_seq=96)
    if pipeline:  # generate(persistent=True) takes the step made here
        model.persistent_step(batch, **pipeline)
    tokens = prompt(TINY, batch, 9, seed=batch).cuda()
    theirs = hf_reference.greedy(hf, tokens, 64)
    graphed = model.generate(tokens, 64, graph=True)
    mine = model.generate(tokens, 64, persistent=True)
    agree = float((mine == theirs).float().mean())
    print(
        f"{dtype} batch {batch}: persistent = HF on {agree:.1%} of tokens, "
        f"= graph: {torch.equal(mine, graphed)}"
    )
    assert torch.equal(mine, graphed)
    assert torch.equal(mine, theirs)


@gpu
def test_gpu_watchdog_instead_of_a_hang():
    hf = hf_reference.random_llama(TINY, seed=6, dtype=torch.bfloat16, device="cuda")
    model = Decoder(DecoderWeights.from_hf(hf), max_batch=1, max_seq=16)
    model.prefill(prompt(TINY, 1, 4).cuda())
    step = PersistentStep(model, 1, spin_limit=1 << 16)
    step.start(torch.tensor([1], device="cuda"), model.cache.length)
    bad = sched.counter_index(TINY.n_layers, 2, "down")
    step.launch(bad_counter=bad)
    with pytest.raises(WatchdogTimeout, match=f"counter {bad} \\(layer 2, phase down\\)"):
        step.check()


# ------------------------------------------------------------------------------------------------
# Compiled for sm_90 without a GPU: every program of the launch fits on the SMs at once

# the 6.4 launch, the fastest persistent step measured, with and without attention_dot (6.5)
FASTEST = {"pipelined_k": 1024, "pipeline_stages": 3, "defer_reduce": True, "pipelined_qkv": True}
OFFLINE = [
    ("1b", "bfloat16", 1, {}),
    ("1b", "bfloat16", 1, {"programs_per_sm": 2, "num_warps": 4}),
    ("1b", "bfloat16", 8, {}),
    ("1b", "bfloat16", 1, {"pipelined_k": 512, "pipeline_stages": 5}),
    ("1b", "bfloat16", 1, {"pipelined_k": 1024, "pipeline_stages": 3, "defer_reduce": True}),
    ("1b", "bfloat16", 1, FASTEST),
    ("1b", "bfloat16", 1, FASTEST | {"attention_dot": True}),
]


@pytest.mark.cpu
def test_every_program_is_resident_on_hopper():
    """A program that is not resident cannot arrive on a counter: the launch must fit the SMs by
    registers and shared memory. Compiled in a process of its own (this one interprets). The
    pipelined GEMV phases must load through shared memory (cp.async): the compiler declines
    loads whose alignment it cannot prove, and then nothing is in flight across steps."""
    from kernels.decoder.persistent_offline import REGISTERS_PER_SM, programs_per_sm_that_fit
    from kernels.matmul.offline import compile_offline

    variants = [{"config": c, "dtype": d, "batch": b, **o} for c, d, b, o in OFFLINE]
    made = compile_offline("kernels.decoder.persistent_offline", variants)
    for options, one in zip(variants, made):
        launched = options.get("programs_per_sm", 1)
        assert programs_per_sm_that_fit(one["registers"], one["warps"]) >= launched, options
        assert one["registers"] * 32 * one["warps"] * launched <= REGISTERS_PER_SM
        assert one["shared_bytes"] * launched <= 227 * 1024
        if launched == 1:
            assert one["spill_bytes"] == 0, options
        assert (one["async_copies"] > 0) == bool(options.get("pipelined_k")), options
