"""Scratch (not part of the course): the ncu comparison of the Gluon forward and FlashAttention's CuTe
DSL forward at (16, 16, 2048, 64) fp16 non-causal, from the exported CSVs beside this file (launches 0
and 1 of 5-ncu_d64.py's range): executed instructions by opcode, and the instructions where warps sat
at a barrier (PC sampling). Run from this folder: python 5-ncu_summary.py > 5-ncu-summary.txt"""
import collections
import csv
import gzip


def sass(path):
    rows = list(csv.reader(gzip.open(path, "rt")))
    header, body = rows[1], rows[2:]
    return [dict(zip(header, r)) for r in body]


def opcode(source):
    words = source.split()
    word = words[1] if words and words[0].startswith("@") else (words[0] if words else "")
    return word.split(".")[0]


kernels = {"Gluon (course)": sass("5-sass-gluon-d64.csv.gz"),
           "flash-attn cute": sass("5-sass-flash-attn-cute-d64.csv.gz")}
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
    print(f"\n{name}: {total} samples, {barrier} at a barrier; the five instructions with the most:")
    for r in sorted(rows, key=lambda r: -int(r["stall_barrier"] or 0))[:5]:
        print(f"  {r['Source'].strip()[:50]:50s} barrier {r['stall_barrier']:>6s}  "
              f"executed {r['Instructions Executed']:>8s} times")
