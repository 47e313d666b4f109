"""What an all-reduce costs, before measuring it: bytes per rank, alpha-beta time, bus bandwidth,
and how much of it a data-parallel step can hide behind the backward pass.

The alpha-beta model (Thakur, Rabenseifner and Gropp, "Optimization of collective communication
operations in MPICH", 2005): sending m bytes from one rank to another takes alpha + m / beta, alpha
the latency of one message and beta the bandwidth of one link. For an all-reduce of S bytes on N
ranks:

* ring (reduce-scatter + all-gather): 2 (N - 1) steps, each sending S / N bytes per rank
      T_ring = 2 (N - 1) * alpha + 2 (N - 1) / N * S / beta
  bytes each rank sends: 2 (N - 1) / N * S (and receives as many);
* binomial tree (reduce to rank 0, then broadcast): 2 ceil(log2 N) steps of the whole message
      T_tree = 2 ceil(log2 N) * (alpha + S / beta)
  bytes the root sends (and receives): ceil(log2 N) * S each. Few steps, so cheaper for small
  messages; the ring wins once S / beta dominates. (NCCL pipelines its trees in chunks and so gets
  near the ring's bandwidth with log-many latencies; this is the unpipelined textbook tree.)

Bus bandwidth (the convention of NVIDIA's nccl-tests): algbw = S / t, busbw = algbw * 2 (N - 1) / N,
the rate at which each rank's link moved the ring's bytes. Comparable across N, and equal to the
link bandwidth beta for an ideal ring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def ring_bytes_per_rank(size_bytes: float, world: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce."""
    return 2 * (world - 1) / world * size_bytes


def tree_bytes_per_rank(size_bytes: float, world: int) -> float:
    """Bytes the busiest rank (the root) sends, and receives, in a binomial-tree reduce and
    broadcast."""
    return math.ceil(math.log2(world)) * size_bytes if world > 1 else 0.0


def ring_time(size_bytes: float, world: int, alpha_s: float, beta_bps: float) -> float:
    return 2 * (world - 1) * alpha_s + ring_bytes_per_rank(size_bytes, world) / beta_bps


def tree_time(size_bytes: float, world: int, alpha_s: float, beta_bps: float) -> float:
    steps = 2 * math.ceil(math.log2(world)) if world > 1 else 0
    return steps * (alpha_s + size_bytes / beta_bps)


def bus_bandwidth(size_bytes: float, world: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of `size_bytes` that took `seconds` (bytes/s)."""
    return size_bytes / seconds * 2 * (world - 1) / world


def fit_alpha_beta(sizes_bytes, seconds) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (bytes/s) of t = alpha + m / beta over point-to-point
    timings of messages of m bytes (one direction)."""
    n = len(sizes_bytes)
    mx, my = sum(sizes_bytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, seconds)) / sxx
    return max(my - slope * mx, 0.0), 1.0 / slope


@dataclass(frozen=True)
class OverlapPrediction:
    compute_s: float  # backward alone
    comm_s: float  # every bucket's all-reduce, back to back, with nothing else running
    exposed_s: float  # communication still running after backward ends
    step_s: float  # backward + exposed communication

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_s / self.comm_s if self.comm_s > 0 else 1.0


def overlap(
    bucket_bytes: list[float],
    backward_s: float,
    world: int,
    alpha_s: float,
    beta_bps: float,
) -> OverlapPrediction:
    """The communication a bucketed data-parallel backward pass hides, as a schedule.

    Bucket i (in the order backward completes them) is ready once the backward pass has produced its
    gradients; backward is assumed to produce bytes of gradient at a steady rate (a model whose
    layers are alike). Its ring all-reduce starts when it is ready and the previous one is done
    (one at a time: they share the links). What runs past the end of backward is exposed; the last
    bucket's all-reduce always is, so many small buckets hide more but pay alpha more often.
    """
    total = sum(bucket_bytes)
    done_bytes, link_free = 0.0, 0.0
    comm = 0.0
    for size in bucket_bytes:
        done_bytes += size
        ready = backward_s * done_bytes / total
        t = ring_time(size, world, alpha_s, beta_bps)
        comm += t
        link_free = max(ready, link_free) + t
    exposed = max(0.0, link_free - backward_s)
    return OverlapPrediction(backward_s, comm, exposed, backward_s + exposed)
