"""The worker's sandbox: bubblewrap (`bwrap`; Debian's package `bubblewrap`), the unprivileged
sandbox Flatpak is built on, rather than one of our own.

Inside it the worker sees only what it needs, read-only: the system (`SYSTEM`), the Python that
runs the grader and its packages, and the course without its answer key and without any report
(`solutions/`, `.git`, the report folder and the class's submissions are empty folders there).
It writes only its own temporary directory; /tmp and /dev/shm are its own and count against its
memory (a tmpfs of at most --memory-gib each, whose use the grader adds to the worker's). It has
no network (a new network namespace, so no abstract UNIX socket of the host either) and no host
UNIX socket (none of /run, /var, /home is there), cannot see or signal any other process (a new PID
namespace, a new session without the terminal), and cannot outlive the grading run: bwrap gets
SIGKILL when the process that started it dies (Linux's parent-death signal, set before bwrap
starts, so there is no moment without it), `--die-with-parent` passes that on to the worker, and
the PID namespace ends with its first process, taking along everything the student's code started.

Where bwrap is missing or cannot create namespaces (some containers), `python -m grading` says so
and, unless the sandbox was required (`--sandbox require`, the default with `--submissions`), grades
without it: the verdicts are still made in the parent process, but the student's code can then
read and write wherever the user can, use the network, and leave processes behind
(grading/README.md).
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


# Read-only: the system's programs, libraries and configuration (/sys for the GPU's driver).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys")
# Inside the course, never shown to the student's code: the answer key, the history that holds it,
# and the default report folder (the partial report holds every lab's secret seed).
COURSE_SECRETS = ("solutions", ".git", "grading-reports")


def python_paths() -> list[str]:
    """The Python running the grader and the folders it imports from (a virtual environment,
    site-packages, PYTHONPATH, editable installs), but not sys.path[0]: the folder of the script
    that was run, or the current one. Never / or the home folder as a whole."""
    prefixes = [sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parent)]
    broad = {Path("/"), Path.home(), Path("/tmp")}
    return [p for p in prefixes + sys.path[1:]
            if p and Path(p).is_absolute() and Path(p).resolve() not in broad]


def _visible(paths) -> list[str]:
    """Existing folders and files, resolved, each once, none below another."""
    found = sorted({str(Path(p).resolve()) for p in paths if Path(p).exists()})
    return [p for p in found
            if not any(p != q and Path(p).is_relative_to(q) for q in found)]


def _base(workdir: str, gpu: bool, hidden=(), tmpfs_bytes: int | None = None) -> list[str]:
    args = [shutil.which("bwrap") or "bwrap"]
    for path in SYSTEM:  # /bin -> usr/bin on a merged /usr: the same link inside
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # A GPU needs the host's /dev (the NVIDIA device files); a private /dev/shm either way.
    args += ["--dev-bind", "/dev", "/dev"] if gpu else ["--dev", "/dev"]
    size = ["--size", str(tmpfs_bytes)] if tmpfs_bytes else []
    args += [*size, "--tmpfs", "/dev/shm", "--proc", "/proc", *size, "--tmpfs", "/tmp"]
    visible = _visible([COURSE_ROOT, *python_paths()])
    for path in visible:
        if not any(Path(path).is_relative_to(s) for s in SYSTEM):  # else bound with the system
            args += ["--ro-bind", path, path]
    shown = [*SYSTEM, *visible]
    secrets = [COURSE_ROOT / name for name in COURSE_SECRETS] + [Path(h) for h in hidden]
    for path in _visible(secrets):  # an empty folder in its place, where it would show
        if Path(path).is_dir() and any(Path(path).is_relative_to(v) for v in shown) \
                and not Path(workdir).is_relative_to(path):
            args += ["--tmpfs", path]
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


def wrap(cmd: list[str], workdir: str, *, gpu: bool, info_fd: int, hidden=(),
         tmpfs_bytes: int | None = None) -> list[str]:
    """`cmd` run inside the sandbox; bwrap writes {"child-pid": N} (the worker's PID as the grader
    sees it, for its CPU time) to `info_fd`. `hidden`: folders to show empty (the reports, the
    class's submissions)."""
    return [*_base(workdir, gpu, hidden, tmpfs_bytes), "--info-fd", str(info_fd), "--", *cmd]


def tmpfs_bytes_used(pid: int, size: int) -> int:
    """Bytes held in the sandbox's /tmp and /dev/shm (memory, not disk), seen through the
    process's root: only file systems of the `size` the sandbox gave them; 0 where that cannot be
    read."""
    used = 0
    for folder in ("tmp", "dev/shm"):
        try:
            st = os.statvfs(f"/proc/{pid}/root/{folder}")
        except OSError:
            continue
        if st.f_blocks * st.f_frsize == size:
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
    return used
