"""A memory snapshot as a matplotlib timeline: live bytes over time, by allocating frame.

The bytes are stacked and coloured by the Python frame that allocated them.

A snapshot is the dictionary `torch.cuda.memory._snapshot()` returns (the format `torch/cuda/
_memory_viz.py` reads, and pytorch.org/memory_viz opens when pickled): `device_traces[d]` is the
list of what the caching allocator did on device d, in order -- `alloc`, `free_requested`,
`free_completed`, `segment_alloc`, ... -- each with `addr`, `size` and `frames` (innermost first).
The timeline counts an allocation from its `alloc` to its `free_completed` (when the memory can be
reused), as memory_viz's "Active Memory Timeline" does; the x axis is the event number, so a burst
of small allocations is as wide as it is long in events, not in microseconds.

Drawing must stay fast on a real training step (100k events): the bytes per category are built with
NumPy (one row per event, one column per category, a cumulative sum), never in a Python loop per
point.
"""

from __future__ import annotations

import random

import numpy as np

BEFORE = "allocated before recording"
OTHER = "other"
# Frames from these places say how PyTorch allocates, not which line of *your* code asked for it.
_LIBRARY_MARKERS = (
    "/torch/",
    "torch/",
    "<built-in",
    "nn.Module:",
    "/site-packages/",
    "<frozen ",
    "/triton/",
)


def _frame_text(frame: dict) -> str:
    # snapshots converted from torch.profiler put all in name
    if frame.get("filename", "none") == "none":
        return frame.get("name", "?")
    return (
        f"{frame.get('name', '?')} ({frame['filename'].rsplit('/', 1)[-1]}:{frame.get('line', 0)})"
    )


def allocation_frame(frames: list[dict]) -> str:
    """The innermost frame not PyTorch's (or a library's): the user code that allocated."""
    for frame in frames:
        where = f"{frame.get('filename', '')} {frame.get('name', '')}"
        if not any(marker in where for marker in _LIBRARY_MARKERS):
            return _frame_text(frame)
    return _frame_text(frames[0]) if frames else "no Python frame"


def device_trace(snapshot: dict, device: int | None = None) -> list[dict]:
    """The trace of `device`, or of the first device with any events."""
    traces = snapshot.get("device_traces", [])
    if device is not None:
        return traces[device]
    return next((t for t in traces if t), [])


def timeline_arrays(
    snapshot: dict, device: int | None = None, top: int = 10
) -> tuple[np.ndarray, list[str]]:
    """(bytes, labels): bytes[i, k], the live bytes of category k after event i.

    Events are alloc or free_completed.

    The categories are the `top` frames with the largest peak, then "other", then the memory that
    was already allocated when recording began (freed during it, so its size is known from the
    free).
    """
    events = [
        e for e in device_trace(snapshot, device) if e["action"] in ("alloc", "free_completed")
    ]
    label_of_addr: dict[int, int] = {}
    label_ids: dict[str, int] = {}
    frame_ids: dict[
        int, int
    ] = {}  # id(frames list) -> label id: traces share one list per allocation
    cats = np.empty(len(events), dtype=np.int64)
    deltas = np.empty(len(events), dtype=np.float64)
    before = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            key = id(e.get("frames"))
            lab = frame_ids.get(key)
            if lab is None:
                lab = label_ids.setdefault(allocation_frame(e.get("frames") or []), len(label_ids))
                frame_ids[key] = lab
            label_of_addr[e["addr"]] = lab
            cats[i], deltas[i] = lab, e["size"]
        else:
            lab = label_of_addr.pop(e["addr"], before)
            cats[i], deltas[i] = lab, -e["size"]
    names = list(label_ids)
    n_labels = len(names)
    cats[cats == before] = n_labels  # the before-recording category is the last column
    per_label = np.zeros((len(events), n_labels + 1))
    per_label[np.arange(len(events)), cats] = deltas
    live = np.cumsum(per_label, axis=0)
    # memory allocated before recording starts at what its frees add up to, and goes down from there
    live[:, n_labels] -= live[-1, n_labels] if len(events) else 0.0
    peaks = live[:, :n_labels].max(axis=0) if len(events) else np.zeros(n_labels)
    order = list(np.argsort(-peaks)[:top])
    rest = [k for k in range(n_labels) if k not in set(order)]
    columns = [live[:, k] for k in order]
    labels = [names[k] for k in order]
    if rest:
        columns.append(live[:, rest].sum(axis=1))
        labels.append(OTHER)
    if live.shape[0] and live[:, n_labels].any():
        columns.append(live[:, n_labels])
        labels.append(BEFORE)
    data = np.stack(columns, axis=1) if columns else np.zeros((len(events), 0))
    return data, labels


def plot_timeline(
    snapshot: dict,
    ax=None,
    *,
    device: int | None = None,
    top: int = 10,
    title: str | None = None,
    unit: str = "MiB",
    legend: bool = True,
):
    """Draw the snapshot's live memory over events, stacked by allocating frame; return the axes."""
    import matplotlib.pyplot as plt

    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    data, labels = timeline_arrays(snapshot, device, top)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 4))
    if data.shape[0]:
        x = np.arange(data.shape[0])
        colours = plt.get_cmap("tab20").colors
        ax.stackplot(
            x,
            (data / scale).T,
            labels=labels,
            colors=[colours[i % 20] for i in range(len(labels))],
            linewidth=0,
        )
        peak = data.sum(axis=1).max() / scale
        ax.axhline(peak, color="black", linewidth=0.8, linestyle="--")
        ax.text(0, peak, f" peak {peak:,.1f} {unit}", va="bottom", fontsize=8)
        ax.set_xlim(0, max(1, data.shape[0] - 1))
    ax.set_xlabel("allocator event (alloc / free)")
    ax.set_ylabel(f"live memory ({unit})")
    if title:
        ax.set_title(title)
    if legend and labels:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    return ax


def synthetic_snapshot(
    n_events: int, *, n_frames: int = 40, seed: int = 0, device: int = 0
) -> dict:
    """A made-up snapshot in `torch.cuda.memory._snapshot()`'s format with about `n_events` trace
    entries (allocs, free_requested, free_completed): for testing the plot's speed without a GPU."""
    rng = random.Random(seed)
    frames = [
        [
            {"filename": f"/work/model/layer{k % 7}.py", "line": 10 + k, "name": f"forward_{k}"},
            {
                "filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py",
                "line": 1782,
                "name": "_call_impl",
            },
        ]
        for k in range(n_frames)
    ]
    live: list[tuple[int, int, list]] = []
    trace: list[dict] = []
    addr = 1 << 32
    while len(trace) < n_events:
        if live and (rng.random() < 0.48 or len(live) > 2000):
            a, size, fr = live.pop(rng.randrange(len(live)))
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": a, "size": size, "stream": 0, "frames": fr})
        else:
            size = 512 * rng.randint(1, 1 << rng.randint(1, 14))
            fr = frames[min(int(rng.expovariate(0.15)), n_frames - 1)]
            trace.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": fr})
            live.append((addr, size, fr))
            addr += size
    traces = [[] for _ in range(device + 1)]
    traces[device] = trace
    return {"segments": [], "device_traces": traces}
