"""Create .venv with the software stack that fits this machine, and say which one it chose.

    python3 tools/setup_env.py [--stack auto|gpu|gpu-cu12|cpu|system] [--venv .venv]
                               [--extras test,lab] [--dry-run]

(what `make setup` runs; --dry-run only says which stack it would choose). Stacks:

  gpu     an NVIDIA GPU whose driver runs CUDA 13 (580 or newer): torch, Triton and CuPy at the
          versions every GPU result in this repository was measured with (constraints-gpu.txt).
  gpu-cu12  an NVIDIA GPU whose driver is older than 580 (Colab, Kaggle, many clusters): torch's
          newest CUDA 12 wheel on PyPI, the Triton it pins and CuPy's CUDA 12 wheel
          (constraints-gpu-cu12.txt). It needs driver 525.60.13 or newer; below that the CPU stack
          is chosen, and this script says why.
  system  the Python running this script already imports a CUDA build of torch (a conda
          environment, a vendor container): the venv is layered over that Python's packages
          instead of installing a second copy, the course's other packages are added, and the
          versions that differ from the GPU-verified stack are listed with what that may change.
  cpu     no NVIDIA GPU: torch's CPU build and the Triton whose interpreter runs the kernels
          (constraints-cpu.txt). Timings are not measured in this mode.
  auto    (default) system if this Python has a CUDA torch the course accepts, else gpu or
          gpu-cu12 by the CUDA version the driver supports (`nvidia-smi`), else cpu.

The choice is written to .venv/course-stack.json. pip's own settings apply as usual: an offline
machine sets PIP_NO_INDEX=1 and PIP_FIND_LINKS=DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_CONSTRAINTS = ROOT / "constraints.txt"
STACK_CONSTRAINTS = {
    "gpu": ROOT / "constraints-gpu.txt",
    "gpu-cu12": ROOT / "constraints-gpu-cu12.txt",
    "cpu": ROOT / "constraints-cpu.txt",
}
# The extra of pyproject.toml holding each stack's CuPy wheel: cupy-cuda13x or cupy-cuda12x (the CPU
# stack keeps CuPy's CUDA 13 wheel, which imports without a GPU).
CUPY_EXTRAS = {"gpu": "cuda13", "gpu-cu12": "cuda12", "cpu": "cuda13"}
# The packages whose versions decide what the kernels compile to and how fast they run.
STACK_PACKAGES = ("torch", "triton", "cupy")
CUPY_PACKAGES = ("cupy-cuda13x", "cupy-cuda12x")
# The oldest driver of each GPU stack. CUDA 13 needs 580. The CUDA 12.8 stack runs on any CUDA 12
# driver from 525.60.13 on, by CUDA's minor-version compatibility: torch's and CuPy's libraries
# load, and the kernels are compiled to machine code (Triton 3.6 ships CUDA 12.8's ptxas; CuPy's
# NVRTC writes cubins), never to PTX newer than the driver, which it could not compile.
CUDA13_DRIVER = (580,)
CUDA12_DRIVER = (525, 60, 13)
# Pinned even over a system stack's own copy: the capstone is checked against this model code, so
# every student's reference is the release the course was checked with.
REFERENCE_PACKAGES = ("transformers",)


def pinned_versions(path: Path) -> dict[str, str]:
    """{normalized name: version} of the `name==version` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if match:
            pins[normalize(match[1])] = match[2]
    return pins


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions(python: str) -> dict[str, str]:
    """{normalized name: version} of every distribution `python` can import."""
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    found = json.loads(subprocess.check_output([python, "-c", code], text=True))
    return {normalize(name): version for name, version in found.items() if name}


def cuda_torch_version(python: str) -> str | None:
    """The version of the torch `python` imports where it is a CUDA build, else None."""
    code = "import torch; print(torch.__version__ if torch.version.cuda else '')"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def course_torch_floor() -> str:
    """The oldest torch pyproject.toml accepts."""
    return re.search(r'"torch>=([\d.]+)', (ROOT / "pyproject.toml").read_text())[1]


def _smi(*args: str) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def nvidia_driver() -> tuple[str, str | None] | None:
    """(driver version, the CUDA version it supports) as `nvidia-smi` prints them ("550.54.15",
    "12.4"); None where it lists no NVIDIA GPU. The CUDA version is None if the header lacks it."""
    if shutil.which("nvidia-smi") is None or "GPU" not in (_smi("-L") or ""):
        return None
    header = _smi() or ""
    queried = (_smi("--query-gpu=driver_version", "--format=csv,noheader") or "").split()
    in_header = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    driver = queried[0] if queried else in_header[1] if in_header else "unknown"
    return driver, cuda[1] if cuda else None


def gpu_stack_for(driver: str, cuda: str | None) -> tuple[str, str]:
    """(stack, why) for an NVIDIA driver: CUDA 13's stack from 580 (CUDA 13.0) on, CUDA 12's below,
    the CPU stack below 525.60.13, where neither runs."""
    seen = f"driver {driver}" + (f", CUDA {cuda}" if cuda else "")
    driver_version, cuda_version = version_tuple(driver), version_tuple(cuda or "")
    if cuda_version >= (13,) or driver_version >= CUDA13_DRIVER:
        return "gpu", f"nvidia-smi: {seen}"
    if driver_version >= CUDA12_DRIVER or (not driver_version and cuda_version >= (12,)):
        return "gpu-cu12", f"nvidia-smi: {seen}, older than 580, which CUDA 13 needs"
    oldest = ".".join(map(str, CUDA12_DRIVER))
    return "cpu", (
        f"nvidia-smi: {seen}; the course's GPU stacks need driver {oldest} or newer (580 for "
        "the verified one), so this machine gets the CPU stack until the driver is updated"
    )


def choose_stack(requested: str) -> tuple[str, str]:
    """(stack, why) for this machine."""
    if requested != "auto":
        return requested, "asked for (STACK=...)"
    system_torch = cuda_torch_version(sys.executable)
    floor = course_torch_floor()
    if system_torch and version_tuple(system_torch.split("+")[0]) >= version_tuple(floor):
        return "system", f"{sys.executable} already imports a CUDA build of torch"
    found = nvidia_driver()
    if found is None:
        return "cpu", "no NVIDIA GPU found (nvidia-smi lists none)"
    stack, why = gpu_stack_for(*found)
    if system_torch:  # a platform's own torch (Colab's, a cluster module's) older than the course's
        why += f"; this Python's torch {system_torch} is older than {floor}, so not layered over"
    return stack, why


def site_packages(python: str) -> list[str]:
    code = (
        "import json, sysconfig; "
        "print(json.dumps(sorted({sysconfig.get_path(k) for k in ('purelib', 'platlib')})))"
    )
    return json.loads(subprocess.check_output([python, "-c", code], text=True))


def create_venv(venv: Path, stack: str) -> Path:
    """A fresh venv; for the system stack, one that also sees this Python's packages.

    `--system-site-packages` is not enough there: when this Python is itself a venv (a conda env
    or a container's venv), it would expose the base interpreter's packages, not this one's. A .pth
    file naming this Python's site-packages does what is meant, and pip treats what it finds there
    as installed."""
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    if stack == "system":
        purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
        venv_site = Path(subprocess.check_output([str(python), "-c", purelib], text=True).strip())
        lines = [path for path in site_packages(sys.executable) if Path(path).is_dir()]
        (venv_site / "course_base_packages.pth").write_text("\n".join(lines) + "\n")
    return python


def constraints_for(stack: str, python: Path, work: Path) -> list[Path]:
    """The constraints files pip applies. The system stack keeps every package its Python already
    has (pinning those would install second copies), so its file is the shared pins minus those,
    except the reference packages."""
    if stack != "system":
        return [SHARED_CONSTRAINTS, STACK_CONSTRAINTS[stack]]
    present = installed_versions(str(python))
    kept = []
    for line in SHARED_CONSTRAINTS.read_text().splitlines():
        pin = re.match(r"\s*([A-Za-z0-9_.\-]+)==", line)
        if not pin or normalize(pin[1]) not in present or normalize(pin[1]) in REFERENCE_PACKAGES:
            kept.append(line)
    filtered = work / "constraints-system.txt"
    filtered.write_text("\n".join(kept) + "\n")
    return [filtered]


def system_cupy_extra(python: str) -> str:
    """The CuPy wheel that matches the CUDA major version of `python`'s torch."""
    code = "import torch; print(torch.version.cuda or '')"
    cuda = subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()
    return "cuda12" if cuda.startswith("12.") else "cuda13"


def extras_for(requested: str, stack: str) -> str:
    """The optional parts of pyproject.toml to install: EXTRAS (default test, lab and browser;
    the browser test's part is left out with BROWSER_TEST=0), the stack's CuPy wheel, NVML's
    bindings on a GPU stack, plus nvcc as
    wheels where no CUDA toolkit's nvcc is on PATH (CUDA 13's: not on the CUDA 12 stack, whose
    CuPy would find its headers)."""
    extras = [e for e in requested.split(",") if e]
    if os.environ.get("BROWSER_TEST") == "0" and "browser" in extras:
        extras.remove("browser")
    if not {"cuda12", "cuda13"} & set(extras):
        extras.append(CUPY_EXTRAS.get(stack) or system_cupy_extra(sys.executable))
    if stack != "cpu" and "nvml" not in extras:  # the grader's outside view of GPU memory
        extras.append("nvml")
    if shutil.which("nvcc") is None and "nvcc" not in extras and stack != "gpu-cu12":
        extras.append("nvcc")
    return ",".join(extras)


def stack_versions(python: Path) -> dict[str, str | None]:
    """{torch, triton, cupy: installed version}, CuPy under whichever CUDA's wheel is there."""
    installed = installed_versions(str(python))
    cupy = next((installed[p] for p in CUPY_PACKAGES if p in installed), None)
    return {"torch": installed.get("torch"), "triton": installed.get("triton"), "cupy": cupy}


def differences_from_verified(python: Path) -> dict[str, dict[str, str]]:
    """{package: {"installed", "verified"}} for the stack packages whose versions differ from the
    GPU stack the results were measured with (a local label such as +cu130 is no difference)."""
    pins = pinned_versions(STACK_CONSTRAINTS["gpu"]) | pinned_versions(SHARED_CONSTRAINTS)
    verified = {"torch": pins["torch"], "triton": pins["triton"], "cupy": pins["cupy-cuda13x"]}
    installed = stack_versions(python)
    differences = {}
    for package in STACK_PACKAGES:
        have = (installed[package] or "missing").split("+")[0]
        if have != verified[package]:
            differences[package] = {"installed": have, "verified": verified[package]}
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stack", default="auto", choices=["auto", "gpu", "gpu-cu12", "cpu", "system"]
    )
    parser.add_argument("--venv", default=str(ROOT / ".venv"), type=Path)
    parser.add_argument("--extras", default="test,lab,browser")
    parser.add_argument("--dry-run", action="store_true", help="say which stack, install nothing")
    args = parser.parse_args()

    stack, why = choose_stack(args.stack)
    print(f"setup: the {stack} stack ({why})", flush=True)
    if args.dry_run:
        return 0
    python = create_venv(args.venv, stack)
    extras = extras_for(args.extras, stack)
    constraints = constraints_for(stack, python, args.venv)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for path in constraints:
        pip += ["-c", str(path)]
    # Playwright drives Debian's chromium (`make browser`): it never downloads a browser of its own.
    env = {**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"}
    # pip compiles each installed file to bytecode on one core; compileall afterwards uses them
    # all. The bytecode must exist before grading: the grader's sandbox cannot write it, and a
    # worker would compile torch's modules again at every start.
    subprocess.run(pip + ["--no-compile", "-e", f"{ROOT}[{extras}]"], check=True, env=env)
    subprocess.run([str(python), "-m", "compileall", "-qq", "-j", "0", *site_packages(str(python))])

    differences = differences_from_verified(python) if stack != "cpu" else {}
    record = {
        "stack": stack,
        "why": why,
        "extras": extras,
        "versions": stack_versions(python),
        "differs_from_gpu_verified": differences,
    }
    (args.venv / "course-stack.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"setup: {', '.join(f'{p} {v}' for p, v in record['versions'].items())}")
    if stack == "cpu":
        print("setup: CPU mode: Triton kernels run in its interpreter; nothing is timed.")
    elif differences:
        print("setup: WARNING: these differ from the stack the expected tables were measured with:")
        for package, versions in differences.items():
            print(f"  {package} {versions['installed']} (verified: {versions['verified']})")
        fix = (
            "The verified stack needs driver 580 or newer."
            if stack == "gpu-cu12"
            else "`make setup STACK=gpu` installs the verified stack."
        )
        print(
            "  Correctness checks still apply; your timings, the expected-table comparisons and "
            f"the kernels Triton generates may differ. {fix}"
        )
    else:
        print("setup: the stack the expected tables and committed results were measured with.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
