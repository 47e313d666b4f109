"""Driving the course in a real browser: JupyterLab started headless, Debian's chromium through Playwright.

Facts this relies on (checked on a CI-like machine, see ../shared/DESIGN.md):

* Playwright's Python package is pinned in the dev extras; it never downloads a browser here: it
  launches the system's chromium (`executable_path`, default /usr/bin/chromium, or $CHROMIUM).
* chromium runs headless as root only with --no-sandbox; the background-networking flags stop it from
  reaching for Google's hosts on a closed network; every launch gets a fresh user-data dir.
* JupyterLab starts on port 0 (the OS picks a free port; it is read back from the server's runtime
  file, so two runs never race for a port), with a token, in a scratch copy of the notebooks (running
  cells must never write into the repository), with its own config, data and runtime dirs (no user
  settings, no saved workspace), and settings that avoid flakes: every cell attached to the DOM
  (windowing off), no autosave, no news or update pop-ups.
* `window.jupyterapp` (LabApp.expose_app_in_browser) is read only to *wait* (kernel idle, every cell
  executed) and to find cells by their source; everything asserted is what the page shows.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "build" / "test-artifacts" / "browser"  # build/ is git-ignored
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# Lab settings written into the scratch user-settings dir (JupyterLab's own setting ids).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {
        "fetchNews": "false",
        "checkForUpdates": False,
        "doNotDisturbMode": True,
    },
}
SERVER_START_S = 90
KERNEL_READY_MS = 120_000
RUN_ALL_MS = 300_000


def chromium_problem() -> str | None:
    """None if chromium can be launched, else what to do (the test fails with it; it is never skipped)."""
    if Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK):
        return None
    return (
        f"no chromium at {CHROMIUM}: `make browser` installs Debian's chromium (apt-get, as root); "
        "or set CHROMIUM=/path/to/chromium; `make test BROWSER_TEST=0` leaves the browser test out"
    )


def copy_notebooks(relative_paths: list[str], root: Path) -> None:
    """Copy notebooks from the repository into `root`, same relative paths, outputs cleared: whatever the
    page shows afterwards was produced by this run."""
    for rel in relative_paths:
        nb = nbformat.read(REPO / rel, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, dest)


class JupyterLab:
    """`with JupyterLab(root, scratch) as lab:` a JupyterLab server on 127.0.0.1, shut down on exit."""

    def __init__(self, root: Path, scratch: Path):
        self.root, self.scratch = root, scratch
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log_path = scratch / "jupyterlab.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, notebook: str, workspace: str) -> str:
        # A workspace of its own for every page, reset: nothing is restored from an earlier page.
        return (
            f"{self.base_url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"
        )

    def __enter__(self) -> "JupyterLab":
        config, data, runtime_dir = (self.scratch / d for d in ("config", "data", "runtime"))
        for name, values in LAB_SETTINGS.items():
            path = config / "lab" / "user-settings" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        data.mkdir(parents=True, exist_ok=True)
        runtime_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(config),
            "JUPYTER_DATA_DIR": str(data),
            "JUPYTER_RUNTIME_DIR": str(runtime_dir),
            "IPYTHONDIR": str(self.scratch / "ipython"),
            "JUPYTER_PREFER_ENV_PATH": "1",
            "PYTHONUNBUFFERED": "1",
            # The kernels share two cores with the other test worker and chromium: with one thread
            # each, OpenMP does not spin-wait on an oversubscribed CPU (which made a matmul-heavy cell
            # ten times slower). Nothing asserted here depends on speed.
            "OMP_NUM_THREADS": "1",
        }
        # The same server `make lab` starts (this environment's jupyter), headless and private.
        cmd = [
            str(Path(sys.executable).parent / "jupyter"),
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_until_up(runtime_dir)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_up(self, runtime_dir: Path) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"JupyterLab exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            info = runtime_dir / f"jpserver-{self.proc.pid}.json"
            if self.port is None and info.exists():
                try:
                    self.port = json.loads(info.read_text())["port"]
                except (ValueError, KeyError):
                    pass  # written but not complete yet
            if self.port is not None:
                try:
                    with urllib.request.urlopen(
                        f"{self.base_url}/api/status?token={self.token}", timeout=5
                    ) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
            time.sleep(0.2)
        raise RuntimeError(
            f"JupyterLab did not answer within {SERVER_START_S} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.port is not None:
            try:  # the server's own shutdown: it stops its kernels too
                req = urllib.request.Request(
                    f"{self.base_url}/api/shutdown?token={self.token}", method="POST"
                )
                urllib.request.urlopen(req, timeout=10).close()
            except (urllib.error.URLError, OSError):
                pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        # Whatever is left of the server's process group (kernels included): this test started it.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()


# --------------------------------------------------------------------------------------------------
# In the page. JupyterLab's notebook model is read through window.jupyterapp only to wait and to find
# cells; assertions read the DOM (what a student sees).

_NOTEBOOK_STATE = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {
    path: panel.context.path,
    kernel: kernel ? kernel.status : null,
    kernelName: kernel ? kernel.name : null,
    cells: panel.content.widgets.map((c, i) => (c.node.setAttribute('data-test-cell', String(i)), {
      type: c.model.type,
      source: c.model.sharedModel.getSource(),
      count: c.model.type === 'code' ? c.model.executionCount : null,
      running: c.model.type === 'code' ? c.model.executionState === 'running' : false,
      error: c.model.type === 'code' ? c.model.sharedModel.outputs.some(o => o.output_type === 'error') : false,
    })),
  };
}"""


def notebook_state(page) -> dict | None:
    return page.evaluate(_NOTEBOOK_STATE)


def open_notebook(page, lab: JupyterLab, notebook: str, workspace: str) -> dict:
    """Open `notebook` as a student would (its URL), and wait until its kernel is idle."""
    page.goto(lab.url(notebook, workspace))
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=KERNEL_READY_MS)
    page.wait_for_function(
        f"() => {{ const s = ({_NOTEBOOK_STATE})(); return s && s.path === {json.dumps(notebook)} "
        f"&& s.kernel === 'idle'; }}",
        timeout=KERNEL_READY_MS,
    )
    return notebook_state(page)


def run_from_menu(page, item: str, cells: list[int] | None = None) -> dict:
    """Click Run > `item` in the menu bar, as a student would; wait until the kernel is idle and every code
    cell in `cells` (default: all) has run, or one of them has failed."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(
        ".lm-Menu-item:visible .lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")
    ).click()
    page.wait_for_function(
        f"""indices => {{
          const s = ({_NOTEBOOK_STATE})();
          if (!s || s.kernel !== 'idle') return false;
          const code = s.cells.filter((c, i) => c.type === 'code' && (indices === null || indices.includes(i)));
          if (s.cells.some(c => c.running)) return false;
          return code.every(c => c.count !== null) || code.some(c => c.error);
        }}""",
        arg=cells,
        timeout=RUN_ALL_MS,
        polling=250,
    )
    return notebook_state(page)


def run_all(page) -> dict:
    return run_from_menu(page, "Run All Cells")


def run_up_to(page, index: int) -> dict:
    """Select cell `index`, run every cell above it, then it (Run menu, twice)."""
    cell(page, index).locator(".jp-InputPrompt").click()
    run_from_menu(page, "Run All Above Selected Cell", list(range(index)))
    return run_from_menu(page, "Run Selected Cell and Do not Advance", list(range(index + 1)))


def cell(page, index: int):
    """The DOM node of cell `index` (every cell is attached: windowing is off; `notebook_state` numbers them)."""
    return page.locator(f'.jp-NotebookPanel:visible [data-test-cell="{index}"]')


def output_text(page, index: int) -> str:
    out = cell(page, index).locator(".jp-Cell-outputArea")
    return out.inner_text() if out.count() else ""


def screenshot(page, name: str, locator=None, *, element=None) -> Path:
    """Save the page (scrolled to `locator`), or just `element`, as build/test-artifacts/browser/NAME.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    if element is not None:
        element.screenshot(path=str(path))
        return path
    if locator is not None:
        locator.scroll_into_view_if_needed()
    page.screenshot(path=str(path))
    return path
