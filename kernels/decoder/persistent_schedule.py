"""The persistent decode step's schedule as data, and a simulator that proves it cannot deadlock.

The persistent step (triton_persistent_step.py) is one launch of P programs, about one per SM, that
all walk the same list of phases: per layer

    qkv        RMSNorm + the q, k, v rows of the GEMV, RoPE, k and v appended to the cache
    attention  one split of the keys of one (sequence, KV head): a partial softmax
    combine    the splits of one (sequence, query head) merged into the attention output
    o          the output projection + the residual
    gate_up    RMSNorm + gate and up rows of the GEMV + SwiGLU
    down       the down projection + the residual

then `lm_head` (final norm + a slice of the vocabulary, each program keeping its best logit) and
`argmax` (the programs' best logits reduced, one unit per sequence). A phase is cut into units (a
few rows of a weight, one split of one head); program p takes units p, p + P, p + 2P, ...

Between phases there are no kernel boundaries, only counters in global memory. Every phase has its
own counter; a program that has finished its units of a phase adds 1 to it (a release), and a
program that starts a phase first waits (an acquire) until the counter of the phase it reads from
holds P: every program is past that phase, so every unit of it is written. After the last phase
each program adds 1 to `done`; the program that brings it to P sets every counter back to 0 for the
next step (no other program touches a counter after its `done`).

The schedule below says, for each phase, which buffers it reads and writes and which counter it
waits on with which count. `simulate` runs the P programs of that schedule in an arbitrary
interleaving, unit by unit, and checks the two things a wrong schedule breaks: that some program can
always move (no deadlock: a count that can never be reached is one), and that no unit reads a
buffer whose writer phase is not finished, or writes one that a phase still reading it has not
finished with (no data race). tests/test_decoder_persistent.py runs it for every batch 1..32 and
every number of programs the wrapper may choose.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LAYER_PHASES = ("qkv", "attention", "combine", "o", "gate_up", "down")
FINAL_PHASES = ("lm_head", "argmax")
# What each phase reads and writes ("x" is the residual stream, "cache" the KV cache's new
# position, "embed" the embedding rows of the step's tokens).
READS = {
    "qkv": ("x",),
    "attention": ("q", "cache"),
    "combine": ("partials",),
    "o": ("attn", "x"),
    "gate_up": ("x",),
    "down": ("h", "x"),
    "lm_head": ("x",),
    "argmax": ("best",),
}
WRITES = {
    "qkv": ("q", "cache"),
    "attention": ("partials",),
    "combine": ("attn",),
    "o": ("x",),
    "gate_up": ("h",),
    "down": ("x",),
    "lm_head": ("best",),
    "argmax": ("tokens",),
}
# At most this many splits of the keys per (sequence, KV head)
MAX_SPLITS = 16


def attention_splits(batch: int, n_kv_heads: int, n_programs: int) -> int:
    """Splits of the keys: enough (sequence, KV head, split) units to give every program one."""
    return max(1, min(MAX_SPLITS, n_programs // (batch * n_kv_heads)))


@dataclass(frozen=True)
class Tiling:
    """How the persistent step cuts its GEMVs: `half_rows` rows of each of the two row sets a
    paired unit computes (a RoPE pair's halves in qkv, gate and up in gate_up), 2 * half_rows rows
    for a plain unit (o, down, lm_head)."""

    half_rows: int
    splits: int

    @property
    def rows(self) -> int:
        return 2 * self.half_rows


def tiling(config, batch: int, n_programs: int) -> Tiling:
    """Small units for one to four sequences (the product runs on the CUDA cores), 16 rows from
    five (tl.dot's smallest tile)."""
    half = 4 if batch <= 4 else 8
    if (config.head_dim // 2) % half:
        half = config.head_dim // 2
    return Tiling(half, attention_splits(batch, config.n_kv_heads, n_programs))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def phase_units(config, batch: int, tile: Tiling) -> dict[str, int]:
    """Units of each phase."""
    c = config
    return {
        "qkv": (c.n_heads + 2 * c.n_kv_heads) * (c.head_dim // 2 // tile.half_rows),
        "attention": batch * c.n_kv_heads * tile.splits,
        "combine": batch * c.n_heads,
        "o": cdiv(c.hidden_size, tile.rows),
        "gate_up": cdiv(c.intermediate_size, tile.half_rows),
        "down": cdiv(c.hidden_size, tile.rows),
        "lm_head": cdiv(c.vocab_size, tile.rows),
        "argmax": batch,
    }


def counter_index(n_layers: int, layer: int | None, phase: str) -> int:
    """The counter a phase arrives on: layer-major, the final phases after the last layer."""
    if phase in FINAL_PHASES:
        return n_layers * len(LAYER_PHASES) + FINAL_PHASES.index(phase)
    return layer * len(LAYER_PHASES) + LAYER_PHASES.index(phase)


def n_counters(n_layers: int) -> int:
    """The phase counters, then `done`."""
    return n_layers * len(LAYER_PHASES) + len(FINAL_PHASES) + 1


@dataclass(frozen=True)
class Phase:
    name: str
    layer: int | None
    units: int
    counter: int  # the counter this phase arrives on
    wait: tuple[int, int] | None  # (counter, count) to reach before the first unit


def schedule(config, batch: int, n_programs: int) -> list[Phase]:
    """Every program's list of phases, with the wait before each: on the phase just before it.
    Each phase reads what the one before it wrote or what an earlier phase wrote (that finished
    before the one before it could), so waiting on the previous phase is enough; `simulate`
    checks it."""
    units = phase_units(config, batch, tiling(config, batch, n_programs))
    names = [(i, p) for i in range(config.n_layers) for p in LAYER_PHASES]
    names += [(None, p) for p in FINAL_PHASES]
    phases, previous = [], None
    for layer, name in names:
        index = counter_index(config.n_layers, layer, name)
        wait = None if previous is None else (previous, n_programs)
        phases.append(Phase(name, layer, units[name], index, wait))
        previous = index
    return phases


class Deadlock(RuntimeError):
    pass


class DataRace(RuntimeError):
    pass


def simulate(phases: list[Phase], n_programs: int, seed: int = 0) -> int:
    """Run `n_programs` programs through `phases` in a random interleaving and return the number of
    actions taken. A program's phase is two actions: start (its wait must be met; then its units
    begin) and finish (its units are written; it arrives on the phase's counter). Raises Deadlock
    if at some point no program can move and not all are done, DataRace if a program starts a
    phase while the phase that last wrote a buffer it reads is unfinished, or while a phase that
    reads a buffer it overwrites is unfinished. (Checking at a phase's start is the strictest
    point: finished units only grow.)"""
    rng = random.Random(seed)
    counters: dict[int, int] = {}
    finished = [0] * len(phases)  # programs past each phase
    position = [0] * n_programs  # the phase each program is in
    started = [False] * n_programs
    waiting: dict[int, list[int]] = {}  # counter -> programs blocked on it
    ready = list(range(n_programs))

    # For each phase, the earlier phases that write what it reads or read what it overwrites
    hazards = []
    for i, ph in enumerate(phases):
        mine = []
        for j, other in enumerate(phases[:i]):
            reads = [b for b in READS[ph.name] if b in WRITES[other.name]]
            overwrites = [b for b in WRITES[ph.name] if b in READS[other.name]]
            if reads or overwrites:
                what = f"reads {reads[0]} before" if reads else f"overwrites {overwrites[0]} under"
                mine.append(
                    (j, f"{ph.name} (layer {ph.layer}) {what} {other.name} (layer {other.layer})")
                )
        hazards.append(mine)

    def check_start(i: int) -> None:
        for j, message in hazards[i]:
            if finished[j] < n_programs:
                raise DataRace(message)

    actions = 0
    while ready:
        p = ready.pop(rng.randrange(len(ready)))
        i = position[p]
        ph = phases[i]
        actions += 1
        if not started[p]:
            if ph.wait is not None and counters.get(ph.wait[0], 0) < ph.wait[1]:
                waiting.setdefault(ph.wait[0], []).append(p)
                continue
            check_start(i)
            started[p] = True
            ready.append(p)
            continue
        finished[i] += 1
        counters[ph.counter] = counters.get(ph.counter, 0) + 1
        ready.extend(waiting.pop(ph.counter, []))  # they look at the counter again
        position[p], started[p] = i + 1, False
        if i + 1 < len(phases):
            ready.append(p)
    if any(i < len(phases) for i in position):
        stuck = [p for p in range(n_programs) if position[p] < len(phases)]
        ph = phases[position[stuck[0]]]
        raise Deadlock(
            f"{len(stuck)} programs wait forever: program {stuck[0]} before {ph.name} (layer "
            f"{ph.layer}) on counter {ph.wait[0]} for {ph.wait[1]}, which holds "
            f"{counters.get(ph.wait[0], 0)}"
        )
    return actions
