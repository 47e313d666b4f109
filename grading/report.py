"""Scores, grades and the human-readable reports.

* **Points** (correctness): a function earns its points when every correctness case passes.
  Functions that cannot run here (CuPy without a GPU) are left out of the maximum and listed as
  such. Extra-credit functions add their points on top of the maximum (a lab can score 15/10) and
  do not enter the grade.
* **Grade** (performance, GPU only): fixed boundaries on the speed relative to the course's
  reference kernel, measured in the same run: A > 80% on every graded kernel, B > 70%, C > 60%,
  D > 40%, otherwise F. A kernel that is not correct gets F. Without a GPU: "not measured"; a lab
  that times nothing (lab 08), or a run with --no-perf: "not timed", with the reason.

The JSON reports follow grading/report.schema.json (checked by tests/test_grader_lab01.py).
"""

from __future__ import annotations

import csv
import io
import math

from kernels.bench import NOT_MEASURED

REPORT_SCHEMA = "grading-report/1"
# Grades that are no letter because nothing was timed, on purpose (unlike "incomplete": a timed
# function left without a tier).
CORRECTNESS_ONLY = "not timed: the lab grades correctness only"
PERF_OFF = "not timed: --no-perf"
SUMMARY_SCHEMA = "grading-summary/1"


def timed_functions(lab_id: str | None) -> set[str] | None:
    """Names of the lab's functions that have performance configurations, or None for a lab this
    grader does not know (then every function counts, as before)."""
    from grading.labs import get_lab

    try:
        return {f.name for f in get_lab(lab_id).functions if f.perf}
    except KeyError:
        return None


def score_lab(lab: dict, perf: bool = True) -> dict:
    """Points and grade of one graded lab; `perf` False: the run timed nothing (--no-perf)."""
    functions = lab.get("functions", [])
    graded = [f for f in functions if f["status"] != "needs a GPU"]
    points = sum(f["points"] for f in graded)
    max_points = sum(f["max_points"] for f in graded if not f.get("extra_credit"))
    tiers = []
    timed = timed_functions(lab.get("lab"))
    for f in graded:
        # Extra credit is on top of the lab: neither its points' absence nor its speed counts
        # against it. A function the spec never times (a question about a profile) has no tier.
        if f.get("extra_credit") or (timed is not None and f["name"] not in timed):
            continue
        tiers.append(f.get("tier") or ("F" if f["status"] != "pass" else None))
    measured = [t for t in tiers if t]
    on_gpu = lab.get("fingerprint", {}).get("mode") == "gpu"
    if lab.get("interrupted"):
        grade = "interrupted"
    elif timed is not None and not timed:
        grade = CORRECTNESS_ONLY
    elif on_gpu and not perf:
        grade = PERF_OFF
    elif not on_gpu or not measured or None in tiers:
        grade = NOT_MEASURED if not on_gpu else "incomplete"
    else:
        grade = max(measured)  # the worst letter decides: "A on every graded kernel"
    return {
        "points": points,
        "max_points": max_points,
        "needs_gpu": [f["name"] for f in functions if f["status"] == "needs a GPU"],
        "grade": grade,
    }


def json_safe(value):
    """NaN and infinities as strings ("NaN", "Infinity", "-Infinity"): the report is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _fmt(v, spec=".1f"):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stack_lines(report: dict) -> list[str]:
    """A warning per lab whose expected table, for this GPU, was measured with other software."""
    from grading.expected import stack_differences

    fingerprint = report.get("fingerprint") or {}
    if fingerprint.get("mode") != "gpu":
        return []
    lines = []
    for lab in report.get("labs", []):
        differences = stack_differences(lab["lab"], fingerprint)
        if differences:
            what = ", ".join(f"{key} {yours} (table: {table})"
                             for key, (yours, table) in differences.items())
            lines.append(f"- **{lab['lab']}: your software differs from the expected table's**: "
                         f"{what}; timings and tiers may differ from the table for that alone")
    return lines


def markdown(report: dict) -> str:
    fp = report["fingerprint"]
    title = "# Grading report" + (f": {report['student']}" if report.get("student") else "")
    lines = [title, ""]
    if report.get("partial"):
        lines += [
            "**PARTIAL: the run was interrupted; labs marked `interrupted` were not graded.**",
            "",
        ]
    lines += [
        f"- mode: {fp['mode']}"
        + (f" ({fp['gpu']}, driver {fp['driver']}, CUDA {fp['cuda']})" if fp.get("gpu") else ""),
        f"- torch {fp['torch']}, triton {fp['triton']}, cupy {fp['cupy']}, python {fp['python']}",
        f"- grader {report.get('grader_version', '?')}, graded {report['date']}; seeds are per lab "
        "(reproduce with `--seed`)",
    ]
    lines += stack_lines(report)
    lines.append("")
    lines += ["| lab | points | grade | notes |", "|---|---|---|---|"]
    for lab in report["labs"]:
        s = lab["score"]
        notes = "; ".join(lab.get("notes", []) + ([lab["error"]] if lab.get("error") else []))
        lines.append(
            f"| {lab['lab']} | {s['points']}/{s['max_points']} | {s['grade']} | {_cell(notes)} |"
        )
    for lab in report["labs"]:
        lines += [
            "",
            f"## {lab['lab']}: {lab.get('title', '')}",
            "",
            f"notebook `{lab['notebook']}`, seed {lab.get('seed')}",
            "",
        ]
        if lab.get("error"):
            lines += [f"**{lab['error']}**", ""]
        for incident in lab.get("incidents", []):
            where = " / ".join(filter(None, [incident.get("function"), incident.get("step")]))
            lines.append(f"- incident{f' in {where}' if where else ''}: {incident['reason']}")
        if lab.get("incidents"):
            lines.append("")
        lines += ["| function | backend | status | points | message |", "|---|---|---|---|---|"]
        for f in lab.get("functions", []):
            extra = " (extra credit)" if f.get("extra_credit") else ""
            lines.append(
                f"| `{f['name']}`{extra} | {f['backend']} | {f['status']} | "
                f"{f['points']}/{f['max_points']} | "
                f"{_cell(f['message'])} |"
            )
        failing = [
            (f["name"], c) for f in lab.get("functions", []) for c in f["cases"] if not c["ok"]
        ]
        if failing:
            lines += [
                "",
                "| function | case | max abs err | max rel err | worst index (expected, actual) | "
                "NaN/Inf | reason |",
                "|---|---|---|---|---|---|---|",
            ]
            for name, c in failing:
                cmp = c.get("comparison") or {}
                worst = cmp.get("worst_index")
                where = (
                    f"{worst} ({_fmt(cmp.get('expected_at_worst'), '.6g')}, "
                    f"{_fmt(cmp.get('actual_at_worst'), '.6g')})"
                    if worst is not None
                    else "-"
                )
                lines.append(
                    f"| `{name}` | {c['case']} | {_fmt(cmp.get('max_abs_err'), '.3g')} | "
                    f"{_fmt(cmp.get('max_rel_err'), '.3g')} | {where} | "
                    f"{cmp.get('n_nan', '-')}/{cmp.get('n_inf', '-')} | {_cell(c['reason'])} |"
                )
        perf = [(f["name"], p) for f in lab.get("functions", []) for p in f.get("perf", [])]
        if perf:
            lines += [
                "",
                "| config | yours (us) | p10-p90 | reference (us) | torch (us) | vs reference | "
                "GB/s | "
                "% of floor | tier | expected reference on this GPU | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for _, p in perf:
                exp = p.get("expected")
                exp_text = (
                    f"{exp['reference_us']} us ({exp['status']})" if exp else "no row for this GPU"
                )
                spread = (
                    "-"
                    if not p.get("spread_us")
                    else f"{p['spread_us'][0]:.1f}-{p['spread_us'][1]:.1f}"
                )
                lines.append(
                    f"| {p['config']} | {_fmt(p['student_us'])} | {spread} | "
                    f"{_fmt(p['reference_us'])} | "
                    f"{_fmt(p['torch_us'])} | {_fmt(p['ratio_to_reference'], '.2f')}x | "
                    f"{_fmt(p['gbps'], '.0f')} | "
                    f"{_fmt(p['percent_of_floor'], '.0f')} | {p['tier']} | {exp_text} | "
                    f"{_cell(p['note'])} |"
                )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# --explain


def _num(v) -> str:
    return v if isinstance(v, str) else f"{v:.7g}"


def explain(lab: dict) -> str:
    """The failing checks of a lab: the case, its inputs and the worst elements (`--explain`)."""
    lines = []
    for f in lab.get("functions", []):
        if f["status"] in ("pass", "needs a GPU", "not implemented"):
            continue
        lines.append(f"{lab['lab']} / {f['name']}: {f['status'].upper()} -- {f['message']}")
        failing = [c for c in f.get("cases", []) if not c["ok"]]
        if not failing:
            continue
        case = failing[0]
        d = case.get("detail") or {}
        lines.append(
            f"  case {case['case']}, call {d.get('trial', 1)} (reproduce with --seed "
            f"{f.get('seed')}): "
            f"{case['reason']}"
        )
        for t in d.get("inputs", []):
            lines.append(
                f"    input {t['name']}: {t['dtype']} shape {tuple(t['shape'])} stride "
                f"{tuple(t['stride'])}"
            )
        for title, rows in (
            ("worst elements", d.get("worst", [])),
            ("first wrong elements", d.get("first_bad", [])),
        ):
            if not rows:
                continue
            names = list(rows[0].get("inputs", {}))
            lines.append(f"    {title}:")
            header = ["index", *names, "expected", "yours"]
            table = [
                [
                    str(tuple(r["index"]) if len(r["index"]) > 1 else r["index"][0]),
                    *(_num(r["inputs"][n]) for n in names),
                    _num(r["expected"]),
                    _num(r["actual"]),
                ]
                for r in rows
            ]
            widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
            lines.append("      " + "  ".join(h.rjust(w) for h, w in zip(header, widths)))
            lines += [
                "      " + "  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table
            ]
        if len(failing) > 1:
            lines.append(
                f"    ({len(failing) - 1} more failing cases: "
                f"{', '.join(c['case'] for c in failing[1:6])}"
                + (", ..." if len(failing) > 6 else "")
                + ")"
            )
    for incident in lab.get("incidents", []):
        if incident.get("output_tail"):
            lines.append(f'{lab["lab"]}: last output before "{incident["reason"]}":')
            lines += ["    " + line for line in incident["output_tail"].splitlines()[-8:]]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The instructor's summary: students x labs


def lab_status(lab: dict | None) -> str:
    if lab is None:
        return "missing"
    if lab.get("interrupted"):
        return "interrupted"
    if lab.get("error"):
        return "error"
    return "graded"


def summary(
    students: dict[str, dict[str, dict | None]],
    lab_ids: list[str],
    *,
    date: str,
    partial: bool,
    grader_version: str,
) -> dict:
    rows = []
    for student, labs in students.items():
        cells, points, max_points = {}, 0, 0
        for lab_id in lab_ids:
            lab = labs.get(lab_id)
            score = lab["score"] if lab else None
            cells[lab_id] = {
                "status": lab_status(lab),
                "points": score["points"] if score else 0,
                "max_points": score["max_points"] if score else None,
                "grade": score["grade"] if score else None,
                "notes": (lab.get("notes", []) + ([lab["error"]] if lab.get("error") else []))
                if lab
                else [],
            }
            points += cells[lab_id]["points"]
            max_points += cells[lab_id]["max_points"] or 0
        rows.append({"student": student, "labs": cells, "points": points, "max_points": max_points})
    return {
        "schema": SUMMARY_SCHEMA,
        "date": date,
        "partial": partial,
        "grader_version": grader_version,
        "labs": lab_ids,
        "students": rows,
    }


def summary_csv(s: dict) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["student"]
    for lab_id in s["labs"]:
        header += [
            f"{lab_id} points",
            f"{lab_id} max points",
            f"{lab_id} grade",
            f"{lab_id} status",
        ]
    writer.writerow(header + ["total points", "total max points"])
    for row in s["students"]:
        cells = [row["student"]]
        for lab_id in s["labs"]:
            c = row["labs"][lab_id]
            cells += [
                c["points"],
                "" if c["max_points"] is None else c["max_points"],
                c["grade"] or "",
                c["status"],
            ]
        writer.writerow(cells + [row["points"], row["max_points"]])
    return out.getvalue()


def summary_markdown(s: dict) -> str:
    lines = ["# Grading summary", ""]
    if s["partial"]:
        lines += [
            "**PARTIAL: the run was interrupted; cells marked `interrupted` were not graded.**",
            "",
        ]
    lines += [
        f"- {len(s['students'])} students, labs: {', '.join(s['labs'])}",
        f"- grader {s['grader_version']}, {s['date']}; per-student reports in "
        "`students/<name>/report.md`",
        "",
    ]
    lines += [
        "| student | " + " | ".join(s["labs"]) + " | total | notes |",
        "|---|" + "---|" * len(s["labs"]) + "---|---|",
    ]
    for row in s["students"]:
        cells, notes = [], []
        for lab_id in s["labs"]:
            c = row["labs"][lab_id]
            if c["status"] == "missing":
                cells.append("missing")
            else:
                cells.append(
                    f"{c['points']}/{c['max_points']} {c['grade']}"
                    + ("" if c["status"] == "graded" else f" ({c['status']})")
                )
            notes += [f"{lab_id}: {n}" for n in c["notes"]]
        lines.append(
            f"| {_cell(row['student'])} | "
            + " | ".join(cells)
            + f" | {row['points']}/{row['max_points']} | "
            f"{_cell('; '.join(notes))} |"
        )
    return "\n".join(lines) + "\n"
