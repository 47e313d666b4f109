"""`make lab` starts JupyterLab with this environment's Python as the kernel, with no set-up of its own,
even when the user's home directory holds a "python3" kernel spec for some other Python."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.browser.jupyterlab import REPO

RESOLVE = (
    "from jupyter_client.manager import KernelManager; km = KernelManager(kernel_name='python3'); "
    "print(km.kernel_spec.resource_dir); print(km.format_kernel_cmd()[0])"
)


def test_make_lab_runs_this_environments_jupyter_and_prefers_its_kernel_specs():
    dry_run = subprocess.run(
        ["make", "-n", "lab"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    command = next(line for line in dry_run.splitlines() if " lab " in f"{line} ")
    assert "JUPYTER_PREFER_ENV_PATH=1" in command and ".venv/bin/jupyter lab" in command, command


def test_python3_kernel_is_this_environments_python_despite_a_users_own_spec(tmp_path):
    elsewhere = tmp_path / "home-jupyter" / "kernels" / "python3"
    elsewhere.mkdir(parents=True)
    (elsewhere / "kernel.json").write_text(
        json.dumps(
            {
                "argv": ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (someone else's)",
                "language": "python",
            }
        )
    )
    env = {
        **os.environ,
        "JUPYTER_DATA_DIR": str(tmp_path / "home-jupyter"),
        "JUPYTER_PREFER_ENV_PATH": "1",
    }
    env.pop("JUPYTER_PATH", None)
    resource_dir, executable = subprocess.run(
        [sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert Path(executable) == Path(sys.executable), (resource_dir, executable)
    assert Path(resource_dir).is_relative_to(Path(sys.prefix)), resource_dir
