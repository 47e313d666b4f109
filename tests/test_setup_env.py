"""tools/setup_env.py: the stack `make setup` picks from what `nvidia-smi` says of the driver, with
a fake `nvidia-smi` on PATH (driver 550, 570, 580, one too old for any GPU stack, and none)."""

import os
import subprocess
import sys
import textwrap

import pytest

from .test_notebook_numbers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import offline_wheels  # noqa: E402
import setup_env  # noqa: E402

# driver -> the CUDA version its nvidia-smi header prints
DRIVERS = {"470.256.02": "11.4", "550.54.15": "12.4", "570.124.06": "12.8", "580.159.04": "13.0"}


def fake_smi(folder, driver: str | None, gpus: str = "GPU 0: Tesla T4 (UUID: GPU-1234)"):
    """An `nvidia-smi` answering -L, --query-gpu=driver_version and the plain header, in `folder`;
    no executable at all for driver None."""
    folder.mkdir(exist_ok=True)
    if driver is None:
        return folder
    script = folder / "nvidia-smi"
    header = (f"| NVIDIA-SMI {driver}    Driver Version: {driver}    "
              f"CUDA Version: {DRIVERS[driver]}     |")  # fmt: skip
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in
          *-L*) echo "{gpus}" ;;
          *--query-gpu=driver_version*) echo "{driver}" ;;
          *) echo "+-------------------------+"; echo "{header}" ;;
        esac
        """))  # fmt: skip
    script.chmod(0o755)
    return folder


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Put a fake nvidia-smi (or none) first on PATH; this Python's torch counts as CPU-only."""
    monkeypatch.setattr(setup_env, "cuda_torch_version", lambda python: None)

    def use(driver):
        folder = fake_smi(tmp_path / "bin", driver)
        monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")

    return use


@pytest.mark.parametrize(
    "driver, stack",
    [("550.54.15", "gpu-cu12"), ("570.124.06", "gpu-cu12"), ("580.159.04", "gpu"), (None, "cpu")],
)
def test_the_stack_follows_the_drivers_cuda_version(on_path, driver, stack):
    on_path(driver)
    chosen, why = setup_env.choose_stack("auto")
    assert chosen == stack
    if driver:
        assert f"driver {driver}, CUDA {DRIVERS[driver]}" in why
        assert setup_env.nvidia_driver() == (driver, DRIVERS[driver])
    else:
        assert setup_env.nvidia_driver() is None and "no NVIDIA GPU" in why


def test_a_driver_too_old_for_cuda_12_gets_the_cpu_stack_and_one_sentence_why(on_path):
    on_path("470.256.02")
    stack, why = setup_env.choose_stack("auto")
    assert stack == "cpu"
    assert "driver 470.256.02" in why and "need driver 525.60.13 or newer" in why


def test_a_cuda_torch_older_than_the_courses_is_not_layered_over(on_path, monkeypatch):
    on_path("550.54.15")
    monkeypatch.setattr(setup_env, "cuda_torch_version", lambda python: "2.8.0+cu126")
    stack, why = setup_env.choose_stack("auto")
    assert stack == "gpu-cu12" and "torch 2.8.0+cu126 is older than 2.10" in why
    monkeypatch.setattr(setup_env, "cuda_torch_version", lambda python: "2.11.0+cu130")
    assert setup_env.choose_stack("auto")[0] == "system"


def test_an_explicit_stack_is_kept_whatever_the_driver(on_path):
    on_path("550.54.15")
    assert setup_env.choose_stack("gpu")[0] == "gpu"


def test_each_stack_installs_its_own_cupy_wheel(monkeypatch):
    monkeypatch.setattr(setup_env.shutil, "which", lambda name: "/usr/bin/nvcc")
    assert setup_env.extras_for("test", "gpu") == "test,cuda13,nvml"
    assert setup_env.extras_for("test", "gpu-cu12") == "test,cuda12,nvml"
    assert setup_env.extras_for("test", "cpu") == "test,cuda13"  # NVML: GPU stacks only
    assert setup_env.extras_for("test,cuda12", "gpu") == "test,cuda12,nvml"  # asked for: kept
    # no nvcc on PATH: CUDA 13's as wheels, except on the CUDA 12 stack
    monkeypatch.setattr(setup_env.shutil, "which", lambda name: None)
    assert setup_env.extras_for("test", "gpu") == "test,cuda13,nvml,nvcc"
    assert setup_env.extras_for("test", "gpu-cu12") == "test,cuda12,nvml"


def test_the_cuda_12_pins_are_a_cuda_12_stack_with_the_gpu_stacks_triton():
    cu12 = setup_env.pinned_versions(setup_env.STACK_CONSTRAINTS["gpu-cu12"])
    cu13 = setup_env.pinned_versions(setup_env.STACK_CONSTRAINTS["gpu"])
    assert cu12["torch"] == "2.10.0" and cu12["triton"] == cu13["triton"] == "3.6.0"
    assert "cupy-cuda12x" in cu12 and "cupy-cuda13x" not in cu12
    nvidia = [name for name in cu12 if name.startswith("nvidia-")]
    assert nvidia and all(name.endswith("-cu12") for name in nvidia)
    base = {r.name for r in offline_wheels.course_requirements([])}
    assert not any(name.startswith("cupy") for name in base)  # each stack picks its wheel
    cuda12 = {r.name for r in offline_wheels.course_requirements(["cuda12"])}
    assert cuda12 - base == {"cupy-cuda12x"}


# A Python with a CUDA torch picks the system stack before looking at the driver: this one's is CPU.
@pytest.mark.cpu
def test_make_setups_script_picks_cuda_12_for_driver_550(tmp_path):
    """What `make setup` runs, in its own process, with driver 550's nvidia-smi first on PATH."""
    folder = fake_smi(tmp_path / "bin", "550.54.15")
    env = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "setup_env.py"), "--dry-run",
         "--venv", str(tmp_path / "venv")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "setup: the gpu-cu12 stack (nvidia-smi: driver 550.54.15, CUDA 12.4" in done.stdout
    assert not (tmp_path / "venv").exists()
