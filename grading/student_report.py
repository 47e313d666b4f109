"""A one-page benchmark report of a student's kernels, to hand in beside the grade.

    python -m grading.student_report REPORT_DIR [--out DIR]

reads REPORT_DIR/report.json (what `python -m grading` or `make grade` wrote) and writes, next to it
(or to --out), `benchmark.md` and `benchmark.png`:

* the machine (GPU, driver, CUDA, torch, Triton, CuPy) and each lab's points and grade;
* for every timed configuration: the student's time, the course's reference kernel and PyTorch timed
  in the same run, the speed relative to the reference (what the grade is read from) and its tier,
  and the fraction of the hardware floor reached;
* the expected-results table for this GPU model (`data/expected/<lab>.yaml`): what the reference
  took when the course measured it, and the times that reach the target (B) and excellent (A)
  tiers, so a student can tell a slow kernel from a slow or busy machine;
* a plot of the same: one bar per configuration, the speed relative to the reference, the tiers.

Without a GPU nothing was timed: the page says so and lists correctness only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grading import expected

# The grade's boundaries on speed relative to the reference kernel (see grading/report.py).
TIERS = (("A", 0.8), ("B", 0.7), ("C", 0.6), ("D", 0.4))
MD_NAME, PNG_NAME = "benchmark.md", "benchmark.png"


def rows(report: dict) -> list[dict]:
    """One row per timed configuration, with the same run's numbers and the expected table's."""
    slug = report.get("fingerprint", {}).get("gpu_slug")
    out = []
    for lab in report.get("labs", []):
        table = expected.load(lab["lab"], slug) if slug else None
        for fn in lab.get("functions", []):
            for perf in fn.get("perf", []):
                row = expected.row(table, perf["config"]) or perf.get("expected") or {}
                out.append({
                    "lab": lab["lab"], "kernel": fn["name"], "config": perf["config"],
                    "extra_credit": bool(fn.get("extra_credit")),
                    "correct": perf.get("correct", True),
                    "student_us": perf["student_us"], "reference_us": perf["reference_us"],
                    "torch_us": perf.get("torch_us"), "ratio": perf["ratio_to_reference"],
                    "tier": perf.get("tier"), "percent_of_floor": perf.get("percent_of_floor"),
                    "expected_reference_us": row.get("reference_us"),
                    "target_us": row.get("target_us"), "excellent_us": row.get("excellent_us"),
                    "expected_status": row.get("status"),
                })
    return out


def _us(value) -> str:
    if value is None:
        return "—"
    return f"{value / 1e3:,.2f} ms" if value >= 1e4 else f"{value:,.1f} µs"


def _pct(value) -> str:
    return "—" if value is None else f"{value:.0f}%"


def markdown(report: dict, table_rows: list[dict], png_name: str | None) -> str:
    fp = report.get("fingerprint", {})
    on_gpu = fp.get("mode") == "gpu"
    lines = ["# Benchmark report", ""]
    if on_gpu:
        software = (f"driver {fp.get('driver')}, CUDA {fp.get('cuda')}, torch {fp.get('torch')}, "
                    f"Triton {fp.get('triton')}, CuPy {fp.get('cupy')}")
        date = str(report.get("date", ""))[:10]
        lines += [f"Measured on **{fp.get('gpu')}** ({software}), {date}. "
                  "Every time is the median of interleaved rounds with L2 flushed; the reference "
                  "kernel and PyTorch were timed in the same run, so the ratios compare like with "
                  "like.", ""]
    else:
        lines += ["**Not measured: no GPU.** This grading ran in Triton's interpreter, which "
                  "checks correctness only. Run `make grade` on a GPU for the timings, the tiers "
                  "and the plot.", ""]
    lines += ["| lab | points | grade |", "|---|---|---|"]
    for lab in report.get("labs", []):
        score = lab.get("score", {})
        needs = f" ({len(score['needs_gpu'])} need a GPU)" if score.get("needs_gpu") else ""
        lines.append(f"| {lab['lab']} | {score.get('points')}/{score.get('max_points')}{needs} | "
                     f"{score.get('grade')} |")
    lines.append("")
    if not table_rows:
        return "\n".join(lines) + "\n"
    lines += ["## Your kernels against the reference, same run", "",
              "| kernel | configuration | yours | reference | PyTorch | speed vs reference | tier "
              "| % of floor |", "|---|---|---|---|---|---|---|---|"]
    for r in table_rows:
        name = r["kernel"] + (" (extra credit)" if r["extra_credit"] else "")
        tier = r["tier"] if r["correct"] else "F (wrong results)"
        lines.append(f"| {name} | `{r['config']}` | {_us(r['student_us'])} | "
                     f"{_us(r['reference_us'])} | {_us(r['torch_us'])} | {r['ratio']:.2f}× | "
                     f"{tier} | {_pct(r['percent_of_floor'])} |")
    (a, ta), (b, tb), (c, tc), (d, td) = TIERS
    lines += ["", f"Tiers: {a} above {ta:.0%} of the reference's speed, {b} above {tb:.0%}, "
              f"{c} above {tc:.0%}, {d} above {td:.0%}, else F. \"% of floor\": the bytes (or "
              "flops) over the GPU's measured copy bandwidth (or its published peak rate for the "
              "dtype), divided by your time; 100% is the hardware's limit.", ""]
    with_table = [r for r in table_rows if r["expected_reference_us"]]
    if with_table:
        lines += [f"## Against the expected-results table for the {fp.get('gpu')}", "",
                  "| kernel | configuration | yours | target (B) | excellent (A) | reference, "
                  "table | reference, this run | table's row |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in with_table:
            lines.append(f"| {r['kernel']} | `{r['config']}` | {_us(r['student_us'])} | "
                         f"{_us(r['target_us'])} | "
                         f"{_us(r['excellent_us'])} | {_us(r['expected_reference_us'])} | "
                         f"{_us(r['reference_us'])} | {r['expected_status']} |")
        measured = [r for r in with_table if r["expected_status"] != expected.PREDICTED]
        slow = [r for r in measured if r["reference_us"] > 1.1 * r["expected_reference_us"]]
        if len(measured) < len(with_table):
            note = ("Rows marked \"predicted, not measured\" come from this GPU's published "
                    "bandwidth and peak rates and the efficiency the course's kernels reach on a "
                    "measured GPU (data/expected/README.md); they can be off by tens of percent. "
                    "`make calibrate` measures this machine's own rows. The grade uses the "
                    "same-run ratio either way.")
        elif slow:
            note = (f"In this run the reference kernel was more than 10% slower than the table "
                    f"in {len(slow)} configuration(s): the machine, not your kernel, was slow "
                    "there (another job, a lower clock). The grade uses the same-run ratio, which "
                    "cancels that.")
        else:
            note = ("The reference kernel ran within 10% of the table in every configuration: this "
                    "machine performed as expected.")
        lines += ["", note, ""]
    else:
        lines += ["No expected-results table has a row for this GPU model: the same-run ratios "
                  "above are the comparison.", ""]
    below = [r for r in table_rows if r["ratio"] < TIERS[1][1] or not r["correct"]]
    if below:
        lines += ["## Where to look first", ""]
        lines += [f"* `{r['config']}`: {r['ratio']:.2f}× the reference" + ("" if r["correct"] else
                  ", and its results were wrong") for r in below]
        lines.append("")
    if png_name:
        lines += [f"![speed relative to the reference kernel]({png_name})", ""]
    return "\n".join(lines)


def plot(report: dict, table_rows: list[dict], path: Path) -> None:
    """One horizontal bar per configuration: the speed relative to the reference, and the tiers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["config"] if r["config"].startswith(r["kernel"]) else f"{r['kernel']} {r['config']}"
              for r in table_rows]
    labels = [label + (" *" if r["extra_credit"] else "") for label, r in zip(labels, table_rows)]
    ratios = [r["ratio"] if r["correct"] else 0.0 for r in table_rows]
    colors = ["tab:green" if x >= TIERS[0][1] else "tab:olive" if x >= TIERS[1][1] else "tab:red"
              for x in ratios]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(table_rows) + 1.6), layout="constrained")
    y = range(len(table_rows))[::-1]
    ax.barh(list(y), ratios, color=colors)
    for yi, x in zip(y, ratios):
        ax.text(x + 0.01, yi, f"{x:.2f}×", va="center", fontsize=8)
    for tier, bound in TIERS:
        ax.axvline(bound, color="gray", ls=":", lw=1)
        ax.text(bound, len(table_rows) - 0.4, f" {tier}", color="gray", fontsize=8)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlim(0, max(1.3, max(ratios, default=1.0) + 0.15))
    ax.set_xlabel("speed relative to the course's reference kernel, same run (1.0 = as fast)")
    fp = report.get("fingerprint", {})
    ax.set_title(f"{fp.get('gpu')}, {str(report.get('date', ''))[:10]}   (* extra credit)",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(report_dir: Path, out_dir: Path | None = None) -> tuple[Path, Path | None]:
    """Write the page (and the plot, when anything was timed); returns their paths."""
    report = json.loads((report_dir / "report.json").read_text())
    out_dir = out_dir or report_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    table_rows = rows(report)
    png = out_dir / PNG_NAME if table_rows else None
    if png:
        plot(report, table_rows, png)
    md = out_dir / MD_NAME
    md.write_text(markdown(report, table_rows, png.name if png else None))
    return md, png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grading.student_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report_dir", type=Path, help="the folder holding report.json")
    parser.add_argument("--out", type=Path,
                        help="where to write benchmark.md and benchmark.png (default: REPORT_DIR)")
    args = parser.parse_args(argv)
    if not (args.report_dir / "report.json").is_file():
        print(f"no report.json in {args.report_dir}: run `python -m grading` (or `make grade`) "
              "first", file=sys.stderr)
        return 2
    md, png = write(args.report_dir, args.out)
    print(f"wrote {md}" + (f" and {png}" if png else " (nothing was timed: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
