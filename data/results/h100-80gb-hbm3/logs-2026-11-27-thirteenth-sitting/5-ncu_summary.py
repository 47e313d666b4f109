"""Scratch (not part of the course): the ncu comparison of the Gluon forward and FlashAttention's CuTe
DSL forward at (16, 16, 2048, 64) fp16 non-causal, from the exported CSVs beside this file (launches 0
and 1 of 5-ncu_d64.py's range): executed instructions by opcode, and the instructions where warps sat
at a barrier (PC sampling). Run from this folder: python 5-ncu_summary.py > 5-ncu-summary.txt; with
two SASS exports as arguments, the same for them (13-ncu-summary.txt: the causal pair of
13-ncu_d64_causal.py, the Gluon kernel with FlashAttention's schedule against FlashAttention's)."""
import collections
import csv
import gzip
import sys


def sass(path):
    rows = list(csv.reader(gzip.open(path, "rt")))
    header, body = rows[1], rows[2:]
    return [dict(zip(header, r)) for r in body]


def opcode(source):
    words = source.split()
    word = words[1] if words and words[0].startswith("@") else (words[0] if words else "")
    return word.split(".")[0]


ours, theirs = sys.argv[1:3] if len(sys.argv) > 2 else ("5-sass-gluon-d64.csv.gz",
                                                        "5-sass-flash-attn-cute-d64.csv.gz")
kernels = {"Gluon (course)": sass(ours), "flash-attn cute": sass(theirs)}
counts = {}
for name, rows in kernels.items():
    c = collections.Counter()
    for r in rows:
        c[opcode(r["Source"])] += int(r["Instructions Executed"] or 0)
    counts[name] = c
a, b = counts.values()
print("executed warp instructions by opcode, millions (Gluon, flash-attn cute, difference)")
print(f"{'all':10s} {sum(a.values()) / 1e6:8.2f} {sum(b.values()) / 1e6:8.2f} "
      f"{(sum(a.values()) - sum(b.values())) / 1e6:+8.2f}")
for op in sorted(set(a) | set(b), key=lambda o: -abs(a[o] - b[o]))[:20]:
    print(f"{op:10s} {a[op] / 1e6:8.2f} {b[op] / 1e6:8.2f} {(a[op] - b[op]) / 1e6:+8.2f}")
for name, rows in kernels.items():
    total = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows)
    barrier = sum(int(r["stall_barrier"] or 0) for r in rows)
    stalls = collections.Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("stall_") and "Not Issued" not in key:
                stalls[key.removeprefix("stall_")] += int(value or 0)
    print(f"\n{name}: {total} samples; by stall reason {dict(stalls.most_common(8))}")
    print(f"{barrier} at a barrier; the five instructions with the most:")
    for r in sorted(rows, key=lambda r: -int(r["stall_barrier"] or 0))[:5]:
        print(f"  {r['Source'].strip()[:50]:50s} barrier {r['stall_barrier']:>6s}  "
              f"executed {r['Instructions Executed']:>8s} times")
