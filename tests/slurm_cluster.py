"""A one-node Slurm cluster on localhost for the class-grading tests: munged, slurmctld and
slurmd from Debian's packages (`make slurm` installs them), every file in a temporary folder, free
ports, so two test runs on one machine do not meet. CPU only."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None
            and not Path("/usr/sbin", name).exists()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Started in a fresh folder directly under /tmp: slurmd's and munge's Unix sockets live there,
    and a socket path may not exceed 108 bytes (pytest's tmp_path under xdist does)."""

    def __init__(self, cpus: int = 2):
        self.root = Path(tempfile.mkdtemp(prefix="slurm-"))
        self.cpus = cpus
        self.pids: list[Path] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def program(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def start(self) -> SlurmCluster:
        munge = self.root / "munge"
        for folder in (munge, self.root / "state", self.root / "spool", self.root / "log"):
            folder.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run([self.program("munged"), f"--key-file={key}",
                        f"--socket={munge / 'munge.sock'}", f"--pid-file={munge / 'munged.pid'}",
                        f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'seed'}",
                        "--force"], check=True, capture_output=True)
        self.pids.append(munge / "munged.pid")
        r = self.root
        (r / "slurm.conf").write_text(f"""\
ClusterName=gradingtest
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={munge / 'munge.sock'}
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=localhost CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        subprocess.run([self.program("slurmctld"), "-c"], env=self.env, check=True)
        self.pids.append(r / "slurmctld.pid")
        subprocess.run([self.program("slurmd")], env=self.env, check=True)
        self.pids.append(r / "slurmd.pid")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True,
                                   text=True).stdout.strip()
            if state in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node never became idle (state {state!r}); "
                           f"logs in {r / 'log'}")

    def submit(self, script: Path) -> str:
        done = subprocess.run(["sbatch", "--parsable", str(script)], env=self.env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"sbatch refused {script}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queued = subprocess.run(["squeue", "-h", "-j", job_id], env=self.env,
                                    capture_output=True, text=True).stdout.strip()
            if not queued:
                return
            time.sleep(1)
        subprocess.run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"Slurm job {job_id} still queued or running after {timeout_s:.0f} s")

    def stop(self) -> None:
        for pid_file in reversed(self.pids):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(1)  # the daemons remove their pid files and sockets as they go
        shutil.rmtree(self.root, ignore_errors=True)
