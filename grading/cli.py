"""`python -m grading`: grade lab notebooks and write JSON and Markdown reports.

Two ways to call it:

  python -m grading [PATH ...]           a student: grade these notebooks (or folders of them;
                                         default labs/) -> OUT/report.json and OUT/report.md
  python -m grading --submissions DIR    an instructor: DIR holds one folder per student; each
                                         student's lab notebooks are graded ->
                                         OUT/students/<student>/report.{json,md} and
                                         OUT/summary.{csv,md,json} (students x labs). Resumable:
                                         a lab whose notebook, source and grader are unchanged
                                         since the last run (same content hash) is not graded
                                         again (--force: regrade).

Each lab is graded in its own worker process, with the solution cells of the student's notebook,
the locked cells of the source notebook in solutions/, and a fresh secret seed (or --seed, to
reproduce a run). A step that hangs, a crash, an out-of-memory or a corrupted CUDA context costs
that function, and the rest of the lab is graded in a new process; other labs are unaffected
(grading/runner.py). Without a GPU, labs are graded side by side, one per core (at most 4); where
they are timed, one at a time. Reports are written atomically; Ctrl-C or SIGTERM writes a report
marked partial (exit status 130). Nothing is written next to the notebooks.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from grading import classroom
from grading import report as report_mod
from grading.integrity import content_hash, grader_version
from grading.labs import LAB_MODULES
from grading.notebooks import lab_id_of, source_path_for
from grading.protocol import STOP, Options
from grading.runner import grade_lab, interrupted_lab, options_dict
from grading.shards import (
    assign_shards,
    now,
    parse_gpus,
    parse_shard,
    student_notebooks,
    write_atomically,
    write_shard_status,
)

EXIT_INTERRUPTED = 130
# Labs graded side by side by default without a GPU, at most: each worker may hold its memory limit
# (--memory-gib) on top of its own, and a laptop's other work needs room too.
AUTO_JOBS_MAX = 4


def find_notebooks(paths: list[Path], only_lab: str | None) -> list[Path]:
    found = []
    for p in paths:
        if p.is_dir():
            found += sorted(p.glob("*_lab.ipynb"))
        elif p.suffix == ".ipynb":
            found.append(p)
        else:
            raise SystemExit(f"grading: {p} is neither a folder nor a .ipynb notebook")
    found = [nb for nb in found if only_lab is None or lab_id_of(nb, LAB_MODULES) == only_lab]
    unknown = [nb.name for nb in found if lab_id_of(nb, LAB_MODULES) not in LAB_MODULES]
    if unknown:
        raise SystemExit(
            f"grading: no lab spec for {', '.join(unknown)} (known: {', '.join(LAB_MODULES)})"
        )
    return found


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_tasks(
    tasks: list[tuple], opts: Options, jobs: int, *, skipped: int = 0, on_result=None
) -> tuple[dict, bool]:
    """Grade (key, notebook, lab_id, seed) tasks in a thread pool (each lab is its own process),
    calling `on_result(key, lab)` in this thread as each lab is done.

    Returns ({key: lab result}, interrupted). On Ctrl-C or SIGTERM the running workers are stopped
    and every lab not graded yet comes back marked interrupted (and goes through `on_result` too).
    """
    from tqdm.auto import tqdm

    STOP.clear()
    results: dict = {}
    interrupted = False

    def finish(key, lab):
        results[key] = lab
        if on_result is not None:
            on_result(key, lab)

    bar = tqdm(
        total=len(tasks) + skipped, initial=skipped, desc="grading", unit="lab", file=sys.stderr
    )
    handlers = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            handlers[sig] = signal.signal(sig, _raise_interrupt)
        except ValueError:  # not the main thread: leave signals alone
            pass
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    futures = {
        pool.submit(grade_lab, nb, lab_id, seed, opts): (key, nb, lab_id, seed)
        for key, nb, lab_id, seed in tasks
    }
    try:
        for future in as_completed(futures):
            key, nb, lab_id, seed = futures[future]
            finish(key, _result(future, nb, lab_id, seed))
            bar.update(1)
            bar.set_postfix_str(str(key[0] if isinstance(key, tuple) else nb.parent.name)[:30])
    except KeyboardInterrupt:
        interrupted = True
        for sig in handlers:
            signal.signal(
                sig, signal.SIG_IGN
            )  # a second Ctrl-C must not stop the reports being written
        STOP.set()
        for future in futures:
            future.cancel()
    finally:
        pool.shutdown(wait=True)
        bar.close()
    for future, (key, nb, lab_id, seed) in futures.items():
        if key not in results:
            done = future.done() and not future.cancelled()
            finish(
                key,
                _result(future, nb, lab_id, seed) if done else interrupted_lab(nb, lab_id, seed),
            )
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    return results, interrupted


def _result(future, nb: Path, lab_id: str, seed: int) -> dict:
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - a bug in the grader must not lose the other labs
        lab = interrupted_lab(nb, lab_id, seed)
        lab.pop("interrupted")
        lab["error"] = f"the grader failed on this lab: {type(exc).__name__}: {exc}"
        for f in lab["functions"]:
            f["message"] = lab["error"]
        return lab


def _report(labs: list[dict], opts: Options, partial: bool, **extra) -> dict:
    from kernels import runtime

    fingerprint = (
        next((lab["fingerprint"] for lab in labs if "fingerprint" in lab), None)
        or runtime.fingerprint()
    )
    return {
        "schema": report_mod.REPORT_SCHEMA,
        **extra,
        "date": now(),
        "partial": partial,
        "grader_version": grader_version(),
        "options": options_dict(opts),
        "fingerprint": fingerprint,
        "labs": labs,
    }


def write_report(folder: Path, report: dict) -> None:
    write_atomically(
        folder / "report.json", json.dumps(report_mod.json_safe(report), indent=1, default=str)
    )
    write_atomically(folder / "report.md", report_mod.markdown(report))


def _seed(args) -> int:
    return args.seed if args.seed is not None else secrets.randbits(31)


def _print_explanations(labs: list[dict], stream) -> None:
    for lab in labs:
        text = report_mod.explain(lab)
        if text:
            print(text, file=stream)


def grade_paths(args, opts: Options, jobs: int) -> int:
    notebooks = find_notebooks(args.paths, args.lab)
    if not notebooks:
        print("grading: no *_lab.ipynb notebooks found", file=sys.stderr)
        return 1
    tasks = [(i, nb, lab_id_of(nb, LAB_MODULES), _seed(args)) for i, nb in enumerate(notebooks)]
    # A report marked partial exists from the start and after every lab: a run killed outright
    # (SIGKILL, a lost machine) leaves it, every lab not yet graded marked interrupted.
    sofar = {i: interrupted_lab(nb, lab_id, seed) for i, nb, lab_id, seed in tasks}

    def write_partial(key=None, lab=None) -> None:
        if key is not None:
            sofar[key] = lab
        labs = [dict(sofar[i]) for i in range(len(tasks))]
        for lab in labs:
            lab["score"] = report_mod.score_lab(lab, opts.perf)
        write_report(args.out, _report(labs, opts, True))

    write_partial()
    results, interrupted = run_tasks(tasks, opts, jobs, on_result=write_partial)
    labs = [results[i] for i in range(len(tasks))]
    for lab in labs:
        lab["score"] = report_mod.score_lab(lab, opts.perf)
    report = _report(labs, opts, interrupted)
    write_report(args.out, report)
    out = sys.stderr if args.json else sys.stdout
    if args.explain:
        _print_explanations(labs, out)
    if args.json:
        print(json.dumps(report_mod.json_safe(report), indent=1, default=str))
    else:
        for lab in labs:
            s = lab["score"]
            print(
                f"{lab['lab']}: {s['points']}/{s['max_points']} points, grade {s['grade']}"
                + (f"  [{lab['error']}]" if lab.get("error") else "")
            )
        print(
            f"report: {args.out / 'report.md'}" + (" (PARTIAL: interrupted)" if interrupted else "")
        )
    if interrupted:
        return EXIT_INTERRUPTED
    if args.write_expected:
        from grading import expected
        from grading.labs import get_lab

        if report["fingerprint"].get("mode") != "gpu":
            print("grading: --write-expected needs a GPU", file=sys.stderr)
            return 1
        for lab in labs:
            if not expected.timed_anything(lab):
                print(f"{lab['lab']}: nothing timed, its expected table left as it is")
                continue
            path = expected.write(
                lab["lab"],
                get_lab(lab["lab"]).title,
                lab["functions"],
                report["fingerprint"],
                source=str(args.out / "report.json"),
            )
            print(f"wrote {path}")
    return 0


def _previous_labs(path: Path) -> dict[str, dict]:
    """The labs of an earlier per-student report that were really graded (not interrupted)."""
    try:
        report = json.loads(path.read_text())
        return {lab["lab"]: lab for lab in report.get("labs", []) if not lab.get("interrupted")}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def grade_submissions(args, opts: Options, jobs: int) -> int:
    root: Path = args.submissions
    if not root.is_dir():
        print(f"grading: {root} is not a folder", file=sys.stderr)
        return 1
    students = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    found = {d.name: student_notebooks(d, args.lab) for d in students}
    if args.gpus:
        return classroom.grade_on_gpus(args)
    if args.shard:
        index, count = args.shard
        shard_of = assign_shards({s: len(nbs) for s, nbs in found.items()}, count)
        found = {s: nbs for s, nbs in found.items() if shard_of[s] == index}
    lab_ids = sorted(
        {lab_id for nbs in found.values() for lab_id in nbs} | ({args.lab} if args.lab else set())
    )
    reports_dir = args.out / "students"
    hash_options = opts.result_options()  # not the seed: a result under any seed is a valid grade
    final: dict[str, dict[str, dict | None]] = {
        s: {lab_id: None for lab_id in lab_ids} for s in found
    }
    previous = {s: _previous_labs(reports_dir / s / "report.json") for s in found}
    tasks, meta, skipped = [], {}, 0
    for student, nbs in found.items():
        for lab_id, (nb, notes) in nbs.items():
            digest = content_hash(nb, source_path_for(nb, lab_id), hash_options)
            prev = previous[student].get(lab_id)
            if prev is not None and prev.get("content_hash") == digest and not args.force:
                final[student][lab_id] = prev
                skipped += 1
                continue
            tasks.append(((student, lab_id), nb, lab_id, _seed(args)))
            meta[(student, lab_id)] = (digest, notes)
    pending = {s: {lab_id for (student, lab_id) in meta if student == s} for s in found}

    def write_student(student: str) -> None:
        labs = [lab for lab in final[student].values() if lab is not None]
        if not labs:
            return  # handed in nothing: the summary says "missing"
        if student not in touched and (reports_dir / student / "report.json").exists():
            return  # nothing new for this student: the earlier report stays as it was
        write_report(
            reports_dir / student,
            _report(labs, opts, any(lab.get("interrupted") for lab in labs), student=student),
        )

    touched: set[str] = set()

    def on_result(key, lab) -> None:
        student, lab_id = key
        digest, notes = meta[key]
        lab["student"] = student
        lab["notes"] = notes + lab.get("notes", [])
        lab["score"] = report_mod.score_lab(lab, opts.perf)
        prev = previous[student].get(lab_id)
        if not lab.get("interrupted"):
            lab["content_hash"] = digest
            touched.add(student)
            final[student][lab_id] = lab
        elif not (prev is not None and prev.get("content_hash") == digest):
            final[student][lab_id] = (
                lab  # else an earlier result for the same submission beats nothing
            )
        pending[student].discard(lab_id)
        if not pending[student]:
            write_student(student)  # as soon as the student is done: an interrupted run keeps it

    for student in found:
        if not pending[student]:
            write_student(student)
    results, interrupted = run_tasks(tasks, opts, jobs, skipped=skipped, on_result=on_result)
    partial = any(
        lab is not None and lab.get("interrupted")
        for labs in final.values()
        for lab in labs.values()
    )
    if args.shard:  # the shards share --out: each writes its own status, `merge` the summary
        write_shard_status(args.out, args.shard, final, partial=partial or interrupted)
        print(
            f"shard {args.shard[0]}/{args.shard[1]}: {len(found)} students, {len(tasks)} labs "
            "graded, "
            f"{skipped} unchanged since the last run (skipped)"
        )
        return EXIT_INTERRUPTED if interrupted else 0
    summary = report_mod.summary(
        final, lab_ids, date=now(), partial=partial, grader_version=grader_version()
    )
    write_atomically(
        args.out / "summary.json", json.dumps(report_mod.json_safe(summary), indent=1, default=str)
    )
    write_atomically(args.out / "summary.csv", report_mod.summary_csv(summary))
    write_atomically(args.out / "summary.md", report_mod.summary_markdown(summary))
    out = sys.stderr if args.json else sys.stdout
    if args.explain:
        _print_explanations([lab for lab in results.values()], out)
    if args.json:
        print(json.dumps(report_mod.json_safe(summary), indent=1, default=str))
    else:
        print(
            f"{len(found)} students, {len(tasks)} labs graded, {skipped} unchanged since the last "
            "run (skipped)"
        )
        print(
            f"summary: {args.out / 'summary.md'}" + (" (PARTIAL: interrupted)" if partial else "")
        )
    return EXIT_INTERRUPTED if interrupted else 0


def _say_where_code_runs(opts: Options) -> None:
    """One line on stderr where the student's code runs without a sandbox (and stop where one is
    required but not available)."""
    from grading.runner import use_sandbox

    sandboxed, how = use_sandbox(opts)
    if not sandboxed and opts.sandbox == "auto":
        print(
            f"grading: the student's code runs without a sandbox ({how.removeprefix('none: ')});"
            f" the verdicts are still made outside it (grading/README.md)",
            file=sys.stderr,
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:  # this GPU's expected rows, measured here (grading/calibrate.py)
        from grading import calibrate

        return calibrate.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m grading",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="*", type=Path, default=[Path("labs")])
    parser.add_argument(
        "--submissions",
        type=Path,
        metavar="DIR",
        help="grade DIR/<student>/ for every student (instructors)",
    )
    parser.add_argument(
        "--shard",
        type=parse_shard,
        metavar="K/N",
        help="with --submissions: grade only shard K of N (python -m grading.classroom)",
    )
    parser.add_argument(
        "--gpus",
        type=parse_gpus,
        metavar="0,1,...",
        help="with --submissions: one shard per GPU of this node, each lab alone on its "
        "GPU, then the merged summary",
    )
    parser.add_argument("--out", type=Path, default=Path("grading-reports"), help="report folder")
    parser.add_argument("--lab", help="grade only this lab id, e.g. 01_elementwise_add")
    parser.add_argument(
        "--cpu", action="store_true", help="force CPU mode (Triton interpreter) even on a GPU"
    )
    parser.add_argument(
        "--seed", type=int, help="reproduce a run (default: a fresh secret seed per lab)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report (or summary) as JSON on stdout"
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print each failing check's inputs and worst elements",
    )
    parser.add_argument(
        "--force", action="store_true", help="with --submissions: regrade unchanged labs too"
    )
    parser.add_argument(
        "--no-perf", action="store_true", help="correctness only: skip the timing on a GPU"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per lab (default 900)")
    parser.add_argument(
        "--call-timeout",
        type=float,
        default=60,
        help="seconds per correctness case or import of the solution cells (default 60)",
    )
    parser.add_argument(
        "--perf-timeout",
        type=float,
        default=300,
        help="seconds per performance configuration (default 300)",
    )
    parser.add_argument(
        "--memory-gib", type=float, default=16, help="host memory per lab, GiB (default 16)"
    )
    parser.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of the GPU's memory a lab may allocate (default 0.9)",
    )
    parser.add_argument(
        "--output-limit-mib",
        type=float,
        default=16,
        help="output (stdout + stderr) a lab may print, MiB (default 16)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="labs graded at once (default: one per core up to "
        f"{AUTO_JOBS_MAX} without a GPU, else 1; on a GPU more only with --no-perf: concurrent "
        "labs distort timings)",
    )
    parser.add_argument(
        "--sandbox",
        choices=("auto", "require", "off"),
        help="run the student's code in bubblewrap: auto (where it works; the "
        "default), require (refuse to grade without it; the default with "
        "--submissions) or off",
    )
    parser.add_argument(
        "--no-kernel-audit",
        action="store_true",
        help="on a GPU, skip the second listing of each passed function's kernels by Nsight "
        "Compute, outside the worker (grading/README.md)",
    )
    parser.add_argument(
        "--write-expected",
        action="store_true",
        help="(instructors, on a GPU, grading solutions/) record the timings in data/expected/",
    )
    args = parser.parse_args(argv)
    if args.submissions and args.write_expected:
        parser.error("--write-expected grades solutions/, not --submissions")
    from kernels import runtime

    if args.cpu and runtime.ON_GPU:
        # This process makes the inputs and references: it must be in the worker's mode, which
        # `import kernels` decided already. Start again in CPU mode.
        env = {**os.environ, "KERNELS_MODE": "cpu"}
        argv = sys.argv[1:] if argv is None else list(argv)
        os.execve(sys.executable, [sys.executable, "-m", "grading", *argv], env)
    sandbox = args.sandbox or ("require" if args.submissions else "auto")
    args.out.mkdir(parents=True, exist_ok=True)  # hidden from the workers from the start
    private = [args.out] + ([args.submissions] if args.submissions else [])
    opts = Options(
        cpu=args.cpu,
        perf=not args.no_perf,
        timeout=args.timeout,
        call_timeout=args.call_timeout,
        perf_timeout=args.perf_timeout,
        memory_gib=args.memory_gib,
        gpu_memory_fraction=args.gpu_memory_fraction,
        output_limit_mib=args.output_limit_mib,
        sandbox=sandbox,
        kernel_audit=not args.no_kernel_audit,
        private=tuple(str(p.resolve()) for p in private),
    )
    _say_where_code_runs(opts)
    cpu_mode = args.cpu or not runtime.ON_GPU
    if args.jobs is None:  # a step's limits count CPU time, so labs side by side cost none of it
        args.jobs = min(AUTO_JOBS_MAX, os.cpu_count() or 1) if cpu_mode else 1
    jobs = args.jobs if (cpu_mode or args.no_perf) else 1
    opts.early_audit = jobs == 1  # an early audit worker holds the audit lock for its whole lab
    if args.submissions:
        return grade_submissions(args, opts, jobs)
    return grade_paths(args, opts, jobs)
