"""Download, on a machine with internet access, the wheels an offline GPU machine needs for
`make setup` on top of the CUDA torch it already has (the system stack of tools/setup_env.py).

    # on the GPU machine (no internet): what its Python already has
    python3 -m pip list --format=freeze > gpu-python.txt
    # here (internet): the course's other packages, at the pinned versions, for that machine
    python3 tools/offline_wheels.py --have gpu-python.txt --dest wheels
    # carry wheels/ over, then on the GPU machine
    PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/wheels make setup EXTRAS=test

It starts from the course's requirements (pyproject.toml: the dependencies and the extras asked
for), skips what the GPU machine's Python already has (except the pinned reference packages, which
the system stack installs over any copy: tools/setup_env.py), downloads each of the others at its
version in constraints.txt as a wheel for that machine's Python and platform, and follows each
wheel's own requirements the same way. It also fetches setuptools, which pip needs to install the
course itself in editable mode.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
    from packaging.requirements import Requirement
except ModuleNotFoundError:  # Python 3.10, or no `packaging`: pip carries both
    from pip._vendor import tomli as tomllib
    from pip._vendor.packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))
from setup_env import (  # noqa: E402 - the sibling script's pins and names
    REFERENCE_PACKAGES,
    ROOT,
    SHARED_CONSTRAINTS,
    normalize,
    pinned_versions,
)

# manylinux tags pip must be told one by one when it downloads for another machine
PLATFORMS = ["manylinux_2_5_x86_64", "manylinux1_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(17, 40)
]


def course_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def wheel_requirements(wheel: Path, environment: dict) -> list[Requirement]:
    """The Requires-Dist lines of a wheel that apply on the target machine (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(metadata).decode()
    requirements = []
    for line in re.findall(r"^Requires-Dist: (.*)$", text, re.M):
        requirement = Requirement(line.strip())
        if requirement.marker is None or requirement.marker.evaluate(environment | {"extra": ""}):
            requirements.append(requirement)
    return requirements


def download(name: str, spec: str, dest: Path, python_version: str) -> Path:
    """One wheel (`spec`, of the distribution `name`), without its dependencies, for the target's
    Python and platform."""
    before = set(dest.glob("*.whl"))
    platforms = [arg for p in PLATFORMS + ["any"] for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "--dest", str(dest), spec],
        check=True,
    )  # fmt: skip
    new = set(dest.glob("*.whl")) - before
    if new:
        return new.pop()
    # already there from an earlier run
    return next(w for w in dest.glob("*.whl") if normalize(w.name.split("-")[0]) == name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--have", type=Path, required=True, help="the GPU machine's `pip list --format=freeze`"
    )
    parser.add_argument("--dest", type=Path, default=Path("wheels"))
    parser.add_argument(
        "--extras",
        default="test,cuda13,nvml",
        help="pyproject extras (default: test,cuda13,nvml; cuda12 for CuPy's CUDA 12 wheel)",
    )
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    args = parser.parse_args()

    # setuptools even if the machine has it: pip builds the editable install in an isolated
    # environment, which takes its build requirements from the wheel folder only
    have = {normalize(line.split("==")[0]) for line in args.have.read_text().splitlines()
            if "==" in line} - set(REFERENCE_PACKAGES) - {"setuptools"}  # fmt: skip
    pins = pinned_versions(SHARED_CONSTRAINTS)
    environment = {
        "python_version": args.python_version,
        "python_full_version": f"{args.python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    args.dest.mkdir(parents=True, exist_ok=True)
    extras = [e for e in args.extras.split(",") if e]
    todo = course_requirements(extras) + [Requirement("setuptools>=69")]
    done, fetched = set(), []
    while todo:
        requirement = todo.pop()
        name = normalize(requirement.name)
        if name in done or name in have:
            continue
        done.add(name)
        spec = f"{requirement.name}=={pins[name]}" if name in pins else str(requirement)
        wheel = download(name, spec, args.dest, args.python_version)
        fetched.append(wheel.name)
        todo += wheel_requirements(wheel, environment)
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl")) / 2**20
    print(f"{len(fetched)} wheels in {args.dest} ({size:.0f} MiB); on the GPU machine:")
    where = args.dest if args.dest.is_absolute() else f"$PWD/{args.dest}"
    print(f"  PIP_NO_INDEX=1 PIP_FIND_LINKS={where} make setup EXTRAS={args.extras}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
