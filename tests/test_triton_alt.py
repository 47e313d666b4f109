"""tools/triton_alt.py: the CUDA 12 stack's Triton installed beside the venv, first on PYTHONPATH
for one command. pip installs from a wheel made here (PIP_NO_INDEX), so the test needs no network;
the real wheel is the one `python tools/triton_alt.py --stack gpu-cu12 -- ...` fetches."""

import os
import subprocess
import sys
import zipfile

from .test_notebook_numbers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import triton_alt  # noqa: E402


def stand_in_wheel(folder, version: str):
    """A wheel named triton, of `version`, whose module says where it was imported from."""
    folder.mkdir()
    wheel = folder / f"triton-{version}-py3-none-any.whl"
    info = f"triton-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("triton/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{info}/METADATA",
                   f"Metadata-Version: 2.1\nName: triton\nVersion: {version}\n")  # fmt: skip
        z.writestr(f"{info}/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")  # fmt: skip
        z.writestr(f"{info}/RECORD", "")
    return folder


def test_the_cuda_12_stacks_triton_is_the_one_its_torch_pins():
    assert triton_alt.stack_triton("gpu-cu12") == "3.6.0"


def test_the_command_imports_the_stacks_triton_from_build(tmp_path):
    version = triton_alt.stack_triton("gpu-cu12")
    wheels = stand_in_wheel(tmp_path / "wheels", version)
    build = tmp_path / "build"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    show = "import triton; print(triton.__version__, triton.__file__)"
    command = [sys.executable, str(ROOT / "tools" / "triton_alt.py"), "--stack", "gpu-cu12",
               "--build-dir", str(build), "--", sys.executable, "-c", show]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    found_version, found_file = first.stdout.split()
    assert found_version == version
    assert found_file == str(build / f"triton-{version}" / "triton" / "__init__.py")
    # the second run reuses the folder: no wheel to install from, and the same Triton imports
    (wheels / f"triton-{version}-py3-none-any.whl").unlink()
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert not list(build.glob(".triton-*.partial"))


def test_the_commands_exit_status_is_passed_on(tmp_path):
    (tmp_path / "triton-9.9.9").mkdir()  # installed already: nothing fetched
    code = triton_alt.main(["--version", "9.9.9", "--build-dir", str(tmp_path), "--",
                            sys.executable, "-c", "raise SystemExit(3)"])  # fmt: skip
    assert code == 3
