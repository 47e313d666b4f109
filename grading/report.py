"""Scores, grades and the human-readable report.

* **Points** (correctness): a function earns its points when every correctness case passes. Functions
  that cannot run here (CuPy without a GPU) are left out of the maximum and listed as such.
* **Grade** (performance, GPU only): seed 003's boundaries on the speed relative to the course's
  reference kernel, measured in the same run: A > 80% on every graded kernel, B > 70%, C > 60%,
  D > 40%, otherwise F. A kernel that is not correct gets F. Without a GPU: "not measured".
"""
from __future__ import annotations

from kernels.bench import NOT_MEASURED


def score_lab(lab: dict) -> dict:
    functions = lab.get("functions", [])
    graded = [f for f in functions if f["status"] != "needs a GPU"]
    points = sum(f["points"] for f in graded)
    max_points = sum(f["max_points"] for f in graded)
    tiers = []
    for f in functions:
        if f["status"] == "needs a GPU":
            continue
        tiers.append(f.get("tier") or ("F" if f["status"] != "pass" else None))
    measured = [t for t in tiers if t]
    if lab.get("fingerprint", {}).get("mode") != "gpu" or not measured or None in tiers:
        grade = NOT_MEASURED if lab.get("fingerprint", {}).get("mode") != "gpu" else "incomplete"
    else:
        grade = max(measured)  # the worst letter decides: "A on every graded kernel"
    return {"points": points, "max_points": max_points,
            "needs_gpu": [f["name"] for f in functions if f["status"] == "needs a GPU"], "grade": grade}


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    fp = report["fingerprint"]
    lines = [f"# Grading report", "",
             f"- mode: {fp['mode']}" + (f" ({fp['gpu']}, driver {fp['driver']}, CUDA {fp['cuda']})" if fp.get("gpu") else ""),
             f"- torch {fp['torch']}, triton {fp['triton']}, cupy {fp['cupy']}, python {fp['python']}",
             f"- graded {report['date']}; seeds are per lab (reproduce with `--seed`)", ""]
    lines += ["| lab | points | grade | notes |", "|---|---|---|---|"]
    for lab in report["labs"]:
        s = lab["score"]
        notes = "; ".join(lab.get("notes", []) + ([lab["error"]] if lab.get("error") else []))
        lines.append(f"| {lab['lab']} | {s['points']}/{s['max_points']} | {s['grade']} | {notes} |")
    for lab in report["labs"]:
        lines += ["", f"## {lab['lab']}: {lab.get('title', '')}", "",
                  f"notebook `{lab['notebook']}`, seed {lab.get('seed')}", ""]
        if lab.get("error"):
            lines += [f"**{lab['error']}**", ""]
        lines += ["| function | backend | status | points | message |", "|---|---|---|---|---|"]
        for f in lab.get("functions", []):
            lines.append(f"| `{f['name']}` | {f['backend']} | {f['status']} | {f['points']}/{f['max_points']} | "
                         f"{f['message']} |")
        failing = [(f["name"], c) for f in lab.get("functions", []) for c in f["cases"] if not c["ok"]]
        if failing:
            lines += ["", "| function | case | max abs err | max rel err | worst index (expected, actual) | NaN/Inf | reason |",
                      "|---|---|---|---|---|---|---|"]
            for name, c in failing:
                cmp = c.get("comparison") or {}
                worst = cmp.get("worst_index")
                where = f"{worst} ({_fmt(cmp.get('expected_at_worst'), '.6g')}, {_fmt(cmp.get('actual_at_worst'), '.6g')})" \
                    if worst is not None else "-"
                lines.append(f"| `{name}` | {c['case']} | {_fmt(cmp.get('max_abs_err'), '.3g')} | "
                             f"{_fmt(cmp.get('max_rel_err'), '.3g')} | {where} | "
                             f"{cmp.get('n_nan', '-')}/{cmp.get('n_inf', '-')} | {c['reason']} |")
        perf = [(f["name"], p) for f in lab.get("functions", []) for p in f.get("perf", [])]
        if perf:
            lines += ["", "| config | yours (us) | p10-p90 | reference (us) | torch (us) | vs reference | GB/s | "
                      "% of floor | tier | expected reference on this GPU | note |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for _, p in perf:
                exp = p.get("expected")
                exp_text = f"{exp['reference_us']} us ({exp['status']})" if exp else "no row for this GPU"
                spread = "-" if not p.get("spread_us") else f"{p['spread_us'][0]:.1f}-{p['spread_us'][1]:.1f}"
                lines.append(f"| {p['config']} | {_fmt(p['student_us'])} | {spread} | {_fmt(p['reference_us'])} | "
                             f"{_fmt(p['torch_us'])} | {_fmt(p['ratio_to_reference'], '.2f')}x | {_fmt(p['gbps'], '.0f')} | "
                             f"{_fmt(p['percent_of_floor'], '.0f')} | {p['tier']} | {exp_text} | {p['note']} |")
    return "\n".join(lines) + "\n"
