"""One lab, graded by this (trusted) process, with the student's code in a watched, sandboxed
worker.

`grade_lab` builds the graded module from the notebook, starts `python -m grading.worker` in a
temporary directory (inside bubblewrap where it can: grading/sandbox.py), and grades each function
with `grading.harness.grade_function` through a `WorkerCaller`: the inputs are made here from the
lab's secret seed and sent to the worker for one call at a time; the worker sends back what the
call did, and the verdict is made here. Nothing the worker writes becomes a verdict unless this
process checked it: its replies are facts about a call (read with `torch.load(weights_only=True)`),
and the values are compared with the references here.

The worker is watched, and stopped at its limits, by grading/protocol.py. When a worker dies or is
stopped while checking a function, that function gets an error with the reason, and the functions
after it are graded in a new worker. A worker that loses its CUDA context says so and exits, with
the same effect.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from grading.protocol import (
    EXIT_CONTEXT_LOST,
    Attempt,
    CleanWorker,
    ContextLostInWorker,
    GraderError,
    Options,
    WorkerCaller,
    WorkerGone,
    WorkerProcess,
    WorkerReplyError,
    death_reason,
    memory_cap,
    worker_env,
)

# --------------------------------------------------------------------------------------------------
# One lab


def _error_function(fn_spec, seed: int, message: str) -> dict:
    from grading.results import error_result

    return error_result(fn_spec, seed, "error", message)


def use_sandbox(opts: Options) -> tuple[bool, str]:
    """(sandboxed, what the report says): bubblewrap, or why not."""
    from grading import sandbox

    if opts.sandbox == "off":
        return False, "off (--sandbox off)"
    usable, why = sandbox.status()
    if usable:
        return True, "bubblewrap"
    if opts.sandbox == "require":
        raise SystemExit(f"grading: the sandbox is required, but {why}")
    return False, f"none: {why}"


# The worker's kinds of step (protocol.WorkerProcess.set_step), as a report's `seconds` names the
# lab's time in each; the kernel audit's is kernel_audit.seconds.
PHASES = {"import": "worker start and import", "call": "correctness", "perf": "performance"}
# What of the correctness phase is not a WorkerCaller round trip (protocol.CALL_PARTS).
IN_GRADER = "grading process: inputs, references, judging"


def _grade_in_worker(worker: WorkerProcess, lab: dict, spec, todo, done: dict, seed: int,
                     opts: Options, unreadable: str | None, folder: Path,
                     clean: CleanWorker | None = None, memory=None) -> None:
    """Grade the functions not done yet in this worker; raises WorkerGone if it dies."""
    from grading import harness
    from grading.diagnosis import Limits
    from kernels import runtime

    worker.set_step(None, "starting the grader's worker", "import")
    worker.receive()  # {"ready": true}
    worker.set_step(None, "importing the solution cells", "import")
    imported = worker.request({"op": "import"})
    limits = imported.get("limits") if isinstance(imported.get("limits"), dict) else {}
    worker.attempt.memory_cap = memory_cap(limits, opts)
    lab["limits"] = limits
    import_error = unreadable or imported.get("import_error")
    worker.set_step(None, "checking the grader's own functions", "import")
    changed = worker.request({"op": "guard"}).get("changed") or []
    if changed:
        import_error = (f"the solution cells replaced part of the grader "
                        f"({', '.join(map(str, changed[:3]))}): not graded")
    if import_error:
        lab["import_error"] = str(import_error)
    context = harness.GradingContext(Limits(limits.get("host_memory_gib"),
                                            limits.get("gpu_memory_gib")), worker.set_step)
    for fn_spec in todo:
        if fn_spec.name in done:
            continue
        if import_error:
            if fn_spec.backend == "cupy" and not runtime.cupy_status()[0]:
                done[fn_spec.name] = harness.error_result(fn_spec, seed, "needs a GPU",
                                                          runtime.cupy_status()[1])
            else:
                done[fn_spec.name] = _error_function(fn_spec, seed, str(import_error))
            continue
        worker.set_step(fn_spec.name, "looking the function up")
        kind = worker.request({"op": "function", "name": fn_spec.name}).get("kind")
        caller = WorkerCaller(worker, folder, fn_spec.name, clean, memory)
        try:
            if fn_spec.grade_group is not None:  # run in a process group, judged here (lab 08)
                result = fn_spec.grade_group(fn_spec, kind, caller.run_group, seed, context.step)
            else:
                result = harness.grade_function(spec, fn_spec.name, kind, caller, seed=seed,
                                                perf=None if opts.perf else False,
                                                context=context)
        except ContextLostInWorker as exc:
            done[fn_spec.name] = _error_function(
                fn_spec, seed, f"case {exc}; the rest of the lab was graded in a new process")
            lab["incidents"].append({"function": fn_spec.name, "step": None,
                                     "reason": "the CUDA context was lost; the rest of the lab was "
                                               "graded in a new process", "output_tail": ""})
            raise
        except (WorkerGone, GraderError, WorkerReplyError):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in this process's checks: the grader's
            where = (worker.step or {}).get("step", "")
            done[fn_spec.name] = _error_function(
                fn_spec, seed, f"{where}: the grader failed (a bug in the grader, not in your "
                               f"code): {type(exc).__name__}: {exc}")
            continue
        if caller.unobserved and memory is not None and not memory.why_not:
            from grading.gpu_memory import unobserved_note

            lab["notes"].append(unobserved_note(f"{fn_spec.name}: its GPU memory budget",
                                                caller.unobserved))
        worker.set_step(fn_spec.name, "checking the grader's own functions")
        changed = worker.request({"op": "guard"}).get("changed") or []
        if changed:
            import_error = (f"{fn_spec.name} replaced part of the grader "
                            f"({', '.join(map(str, changed[:3]))}): not graded")
            done[fn_spec.name] = _error_function(fn_spec, seed, import_error)
        else:
            done[fn_spec.name] = result.as_dict()


def grade_lab(notebook: Path, lab_id: str, seed: int, opts: Options,
              source: Path | None = None) -> dict:
    """Grade one notebook; always returns a lab result (never raises for what the student did)."""
    from grading.labs import get_lab
    from grading.notebooks import (
        locked_cell_status,
        read_notebook,
        solution_module,
        source_path_for,
    )
    from kernels import runtime

    if opts.cpu and runtime.ON_GPU:
        raise ValueError("Options(cpu=True) grades in CPU mode, and this process, which makes the "
                         "inputs, is in GPU mode: start it with KERNELS_MODE=cpu (python -m "
                         "grading --cpu does)")
    spec = get_lab(lab_id)
    given = Path(os.path.abspath(notebook))
    notebook = notebook.resolve()
    source = (source or source_path_for(notebook, lab_id)).resolve()
    lab = {"lab": lab_id, "title": spec.title, "notebook": str(given), "source": str(source),
           "seed": seed, "notes": [], "incidents": [], "functions": []}
    if not source.exists():
        lab["error"] = f"the lab's source notebook {source} does not exist"
        lab["functions"] = [_error_function(f, seed, lab["error"]) for f in spec.functions]
        return lab
    sandboxed, lab["sandbox"] = use_sandbox(opts)
    source_nb = read_notebook(source)
    try:
        refused = linked_notebook(given)
        if refused:
            raise ValueError(refused)
        student_nb = read_notebook(notebook)
    except (OSError, ValueError) as exc:  # not JSON, not a notebook: nothing of it can be graded
        student_nb, unreadable = {"cells": []}, f"the notebook cannot be read: " \
                                                f"{type(exc).__name__}: {exc}"
    else:
        unreadable = None
    code, notes = solution_module(student_nb, source_nb)
    if not unreadable:
        lab["notes"], lab["locked_cells"] = notes, locked_cell_status(student_nb, source_nb)
    else:
        lab["locked_cells"] = []
    lab["fingerprint"] = runtime.fingerprint()
    done: dict[str, dict] = {}
    started = time.monotonic()
    deadline = started + opts.timeout
    env = worker_env(opts)
    cmd = [sys.executable, "-m", "grading.worker", "--lab", lab_id, "--notebook", str(notebook),
           *opts.worker_args()]
    if spec.functions and all(f.run_group for f in spec.functions) and "--cpu" not in cmd:
        cmd.append("--cpu")  # lab 08: CPU processes only, the ranks (ranks.py) and their worker
    audit = opts.kernel_audit and not opts.cpu and runtime.ON_GPU
    if audit:
        from grading import kernel_audit
    with tempfile.TemporaryDirectory(prefix=f"grading-{lab_id}-") as tmp, \
            contextlib.ExitStack() as audit_stack:
        folder = Path(tmp)
        early = None
        if audit:
            audit_work = _worker_folder(folder / "kernel-audit", lab_id, code, False)
            if opts.early_audit:  # its worker starts under ncu while this lab is graded
                early = kernel_audit.EarlyStart(cmd, audit_work, opts, env, sandboxed)
                audit_stack.callback(early.close)
            else:
                kernel_audit.start_probe()  # whether ncu works here, found meanwhile
        clean = None
        timed = [f for f in spec.functions if f.perf and f.grade_group is None]
        if opts.perf and not opts.cpu and runtime.ON_GPU and timed:
            # The course's kernel is timed where no student code ever ran; its start overlaps the
            # grading.
            clean = CleanWorker(cmd, folder / "clean", deadline, opts, env, sandboxed,
                                seed_caches=sandboxed)
            clean.start()
            audit_stack.callback(clean.close)
        memory = None
        if not opts.cpu and runtime.ON_GPU:  # the budgets are checked on a GPU only
            from grading import gpu_memory

            memory = gpu_memory.shared_nvml()
            note = gpu_memory.budget_note(spec, memory)
            if note:
                lab["notes"].append(note)
        seconds: dict[str, float] = {}
        correctness: dict[str, float] = {}
        while len(done) < len(spec.functions):
            work = _worker_folder(folder / f"worker-{len(lab['incidents'])}", lab_id, code,
                                  seed_caches=sandboxed and not opts.cpu and runtime.ON_GPU)
            worker = WorkerProcess(cmd, work, deadline, opts, env, sandboxed)
            try:
                _grade_in_worker(worker, lab, spec, spec.functions, done, seed, opts,
                                 unreadable, work, clean, memory)
                break
            except ContextLostInWorker:
                continue
            except (GraderError, WorkerReplyError) as exc:
                step = worker.step or {}
                fn = step.get("function")
                what = ("the grader failed (a bug in the grader, not in your code)"
                        if isinstance(exc, GraderError) else
                        "the worker's reply could not be read (does the code write to the "
                        "grader's channel?)")
                reason = f"{what}: {exc}"
                lab["incidents"].append({"function": fn, "step": step.get("step"),
                                         "reason": reason, "output_tail": ""})
                if fn is None or fn in done:
                    lab["error"] = reason
                    for f in spec.functions:
                        done.setdefault(f.name, _error_function(f, seed, reason))
                    break
                done[fn] = _error_function(spec.function(fn), seed, f"{step['step']}: {reason}")
            except WorkerGone as gone:
                if _record_death(gone.attempt, lab, spec, done, seed, opts):
                    break
            finally:
                worker.close()
                for kind, secs in worker.seconds_by_kind.items():
                    phase = PHASES.get(kind, kind)
                    seconds[phase] = seconds.get(phase, 0.0) + secs
                for part, secs in worker.call_seconds.items():
                    correctness[part] = correctness.get(part, 0.0) + secs
        if audit and not lab.get("error"):
            # Seeded from the last worker's caches, which hold the student's compiled kernels
            # too: under ncu, which serializes every launch, compiling and autotuning is slow.
            if sandboxed:
                from grading import sandbox

                sandbox.seed_caches(audit_work, from_worker=work)
            kernel_audit.audit_lab(lab, spec, done, seed, opts, env, cmd, audit_work, sandboxed,
                                   early)
    lab["seconds"] = {kind: round(secs, 2) for kind, secs in seconds.items()}
    if correctness:
        correctness[IN_GRADER] = max(0.0, seconds.get(PHASES["call"], 0.0)
                                     - sum(correctness.values()))
        lab["correctness_seconds"] = {part: round(secs, 2) for part, secs in correctness.items()}
    lab["functions"] = [done[f.name] for f in spec.functions]
    lab["elapsed_s"] = round(time.monotonic() - started, 2)
    return lab


def linked_notebook(given: Path) -> str | None:
    """Why a notebook reached through a link is not graded (None if it is not): a link can hand
    in any file the grader can read, the course's solutions among them. A link above the course
    (a course folder that is itself a link) is no such thing."""
    from grading.notebooks import SOLUTIONS_DIR

    if given.is_symlink():
        return f"it is a symbolic link (to {given.resolve()}): hand in the notebook itself"
    answers = SOLUTIONS_DIR.resolve()
    if any(p.is_symlink() and p.resolve().is_relative_to(answers) for p in given.parents):
        return "it is the course's own solution, reached through a link: hand in your notebook"
    return None


def _worker_folder(work: Path, lab_id: str, code: str, seed_caches: bool) -> Path:
    """A fresh folder for one worker, holding the graded module (and, sandboxed on a GPU, copies
    of the user's compiled-kernel caches: grading/sandbox.py)."""
    work.mkdir()
    (work / f"student_{lab_id}.py").write_text(code)
    if seed_caches:
        from grading import sandbox

        sandbox.seed_caches(work)
    return work


def _record_death(attempt: Attempt, lab: dict, spec, done: dict, seed: int,
                  opts: Options) -> bool:
    """Note a dead or stopped worker in the lab; True if the lab cannot go on."""
    step = attempt.step
    if attempt.returncode == EXIT_CONTEXT_LOST and attempt.stopped is None:
        return False  # already recorded from its reply
    reason = death_reason(attempt, opts)
    fn = step.get("function") if step else None
    lab["incidents"].append({"function": fn, "step": step["step"] if step else None,
                             "reason": reason, "output_tail": attempt.output_tail[-2000:]})
    if attempt.stopped in ("interrupted", "lab-timeout") or fn is None or fn in done:
        where = f" ({step['step']})" if step else ""
        final = attempt.stopped in ("interrupted", "lab-timeout")
        lab["error"] = reason if final else f"{reason}{where}"
        if attempt.stopped == "interrupted":
            lab["interrupted"] = True
        for f in spec.functions:
            if f.name not in done:
                done[f.name] = _error_function(
                    f, seed, lab["error"] if f.name != fn else f"{step['step']}: {reason}")
        return True
    done[fn] = _error_function(spec.function(fn), seed, f"{step['step']}: {reason}")
    return False


def interrupted_lab(notebook: Path, lab_id: str, seed: int) -> dict:
    """The result of a lab that was never started because the run was interrupted."""
    from grading.labs import get_lab

    spec = get_lab(lab_id)
    reason = "not graded: the grading run was interrupted"
    return {"lab": lab_id, "title": spec.title, "notebook": str(notebook.resolve()), "seed": seed,
            "notes": [], "incidents": [], "error": reason, "interrupted": True,
            "functions": [_error_function(f, seed, reason) for f in spec.functions]}


def options_dict(opts: Options) -> dict:
    return asdict(opts)
