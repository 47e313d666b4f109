"""Run a command with another Triton release first on PYTHONPATH, leaving .venv as it is.

    python tools/triton_alt.py [--stack gpu-cu12 | --version 3.6.0] -- COMMAND [ARG ...]

CI's venv has the CPU stack's Triton; the GPU stacks pin their own (constraints-gpu.txt,
constraints-gpu-cu12.txt). This installs the stack's Triton wheel, without its dependencies (the
venv's torch stays), into build/triton-<version>/ once, then runs COMMAND with that folder first on
PYTHONPATH, so `import triton` finds it. For instance, to compile the kernels offline
(KERNELS_COMPILE_ONLY=1) with the Triton that a GPU whose driver is older than 580 gets:

    KERNELS_COMPILE_ONLY=1 python tools/triton_alt.py --stack gpu-cu12 -- python SCRIPT.py

The folder is reused while it exists (`rm -r build/triton-*` to start again); pip's own cache keeps
the download between fresh checkouts. pip's settings apply (PIP_NO_INDEX, PIP_FIND_LINKS).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from setup_env import ROOT, STACK_CONSTRAINTS, pinned_versions  # noqa: E402 - the sibling's pins

BUILD_DIR = ROOT / "build"


def stack_triton(stack: str) -> str:
    """The Triton version a stack's constraints file pins."""
    return pinned_versions(STACK_CONSTRAINTS[stack])["triton"]


def install(version: str, build_dir: Path = BUILD_DIR) -> Path:
    """build_dir/triton-<version>, installed there now unless it already is. pip writes to a
    temporary folder renamed at the end, so an interrupted install is never taken for a done one."""
    target = build_dir / f"triton-{version}"
    if target.is_dir():
        return target
    partial = build_dir / f".triton-{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "--target", str(partial), f"triton=={version}"],
        check=True,
    )  # fmt: skip
    partial.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--stack", choices=sorted(STACK_CONSTRAINTS), default="gpu-cu12")
    which.add_argument("--version", help="a Triton release, e.g. 3.6.0 (default: the stack's)")
    parser.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run: add -- COMMAND")
    version = args.version or stack_triton(args.stack)
    target = install(version, args.build_dir)
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    print(f"triton_alt: Triton {version} from {target}", file=sys.stderr, flush=True)
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": path}).returncode


if __name__ == "__main__":
    sys.exit(main())
