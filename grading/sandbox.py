"""The worker's sandbox: bubblewrap (`bwrap`; Debian's package `bubblewrap`), the unprivileged
sandbox Flatpak is built on, rather than one of our own.

Inside it the worker sees the whole file system read-only (the course, the grader, the other labs
and
every report) except its own temporary directory; /tmp and /dev/shm are private. It has no network
(a new network namespace), cannot see or signal any other process (a new PID namespace, a new
session without the terminal), and cannot outlive the grading run: `--die-with-parent` kills it when
the grader dies, even by SIGKILL, and the PID namespace ends with its first process, taking along
everything the student's code started.

Where bwrap is missing or cannot create namespaces (some containers), `python -m grading` says so
and, unless the sandbox was required (`--sandbox require`, the default with `--submissions`), grades
without it: the verdicts are still made in the parent process, but the student's code can then
write wherever the user can, use the network, and leave processes behind (grading/README.md).
"""
from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo "
                "dnf install bubblewrap)")


COURSE_ROOT = Path(__file__).resolve().parents[1]


def under_tmp(paths) -> list[str]:
    """The existing paths among `paths` that lie under /tmp, which the sandbox replaces by a private
    one: the course and the Python running the grader may live there (a CI clone, a venv in /tmp)
    and are bound back, read-only."""
    found = []
    for path in paths:
        resolved = Path(path).resolve()
        if resolved.parts[1:2] == ("tmp",) and resolved.exists() and str(resolved) not in found:
            found.append(str(resolved))
    return found


def _base(workdir: str, gpu: bool, visible: list[str] = ()) -> list[str]:
    args = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/"]
    # A GPU needs the host's /dev (the NVIDIA device files); a private /dev/shm either way.
    args += ["--dev-bind", "/dev", "/dev"] if gpu else ["--dev", "/dev"]
    args += ["--tmpfs", "/dev/shm", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in visible:
        args += ["--ro-bind", path, path]
    args += ["--bind", workdir, workdir, "--chdir", workdir,
             "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
             "--die-with-parent", "--new-session"]
    # Caches the student's code may write (Triton's and CuPy's compiled kernels, ~/.cache): its own.
    for name, sub in (("HOME", ""), ("TRITON_CACHE_DIR", ".triton"), ("CUPY_CACHE_DIR", ".cupy"),
                      ("XDG_CACHE_HOME", ".cache")):
        args += ["--setenv", name, f"{workdir}/{sub}".rstrip("/")]
    return args


@functools.cache
def status() -> tuple[bool, str]:
    """(usable, why not): bwrap is installed and can build the sandbox on this machine."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return False, f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
    try:
        probe = subprocess.run([*_base("/tmp", gpu=False), "--", "true"], capture_output=True,
                               text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"bwrap could not be started: {exc}"
    if probe.returncode:
        why = probe.stderr.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
        return False, (f"bwrap cannot create a sandbox on this machine ({why[0]}): user "
                       f"namespaces may be disabled (e.g. inside a container)")
    return True, ""


CACHE_COPY_LIMIT = 2 * 2**30  # bytes: a larger cache is not copied (the worker compiles afresh)


def seed_caches(workdir: Path, from_worker: Path | None = None) -> None:
    """Copy compiled-kernel caches (Triton's, CuPy's) into the worker's folder, where the sandbox
    points them: by default the user's, so a GPU worker compiles only what is new, as outside the
    sandbox; `from_worker`: another worker's folder for the same submission (the kernel audit's
    worker then does not compile the student's kernels again). Whatever a worker writes there dies
    with its folder (no cache is shared between submissions)."""
    if from_worker is None:
        home = Path.home()
        triton = Path(os.environ.get("TRITON_CACHE_DIR", home / ".triton" / "cache"))
        cupy = Path(os.environ.get("CUPY_CACHE_DIR", home / ".cupy" / "kernel_cache"))
        caches = ((triton, ".triton"), (cupy, ".cupy"))
    else:
        caches = ((from_worker / ".triton", ".triton"), (from_worker / ".cupy", ".cupy"))
    for source, name in caches:
        if not source.is_dir() or source.is_symlink():
            continue
        size = sum(f.lstat().st_size for f in source.rglob("*") if f.is_file())
        if size > CACHE_COPY_LIMIT:
            continue
        try:  # a worker's folder is the student's code's: copy its links as links, skip the rest
            shutil.copytree(source, workdir / name, symlinks=True, dirs_exist_ok=True,
                            ignore=_not_files_or_folders)
        except (OSError, shutil.Error):
            shutil.rmtree(workdir / name, ignore_errors=True)  # the worker compiles afresh


def _not_files_or_folders(folder: str, names: list[str]) -> list[str]:
    """copytree's `ignore`: pipes, sockets and devices, which copying would block on or refuse."""
    kinds = {name: os.lstat(os.path.join(folder, name)).st_mode for name in names}
    return [name for name, mode in kinds.items()
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))]


def wrap(cmd: list[str], workdir: str, *, gpu: bool, info_fd: int) -> list[str]:
    """`cmd` run inside the sandbox; bwrap writes {"child-pid": N} (the worker's PID as the grader
    sees it, for its CPU time) to `info_fd`."""
    needed = [COURSE_ROOT, sys.prefix, sys.base_prefix, Path(sys.executable).resolve().parent]
    needed += [arg for arg in cmd if arg.startswith("/")]
    visible = [p for p in under_tmp(needed) if not p.startswith(workdir)]
    return [*_base(workdir, gpu, visible), "--info-fd", str(info_fd), "--", *cmd]
