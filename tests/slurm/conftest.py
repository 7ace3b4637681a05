"""A real one-node Slurm cluster on this machine: munged, slurmctld and slurmd from Debian.

The cluster fixture (one per test module) installs the packages when they are missing and
``APERTUS_INSTALL_SLURM=1`` asks for it (as root; otherwise the tests skip, saying how), writes a
munge key and a ``slurm.conf`` naming this host (its CPUs and memory as ``slurmd -C`` reports
them, ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres``) into a temporary
directory, starts the three daemons in the foreground on free ports, waits for the node to be
idle, and stops them at teardown, also when a test failed.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from megatron.apertus.launch.slurm import slurm_query

PACKAGES = ["slurmd", "slurmctld", "slurm-client", "munge"]
COMMANDS = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo"]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _missing() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c, path="/usr/sbin:/usr/bin:/sbin:/bin") is None]


INSTALL = "APERTUS_INSTALL_SLURM"
"""Set to 1 to let the fixture apt-get install Slurm: a test run never changes the machine's
packages unless asked."""


def ensure_slurm_installed() -> None:
    """apt-get install the Debian packages if a command is missing and :data:`INSTALL` asks for
    it; skip (saying why) otherwise or when that is impossible."""
    if not _missing():
        return
    if os.environ.get(INSTALL) != "1":
        pytest.skip(
            f"Slurm commands {_missing()} are missing; {INSTALL}=1 lets the tests "
            f"install them (root, apt-get install {' '.join(PACKAGES)})"
        )
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(
            f"Slurm commands {_missing()} are missing and installing them needs root and "
            f"apt-get: apt-get install -y --no-install-recommends {' '.join(PACKAGES)}"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=True)
        subprocess.run(install, env=env, capture_output=True, check=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_definition(host: str) -> str:
    """This machine as ``slurmd -C`` sees it, with a little memory held back: a node whose
    real memory falls below its configured memory is drained."""
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    line = line.splitlines()[0]
    memory = int(re.search(r"RealMemory=(\d+)", line).group(1))
    line = re.sub(r"RealMemory=\d+", f"RealMemory={memory * 9 // 10}", line)
    return (
        line.replace(f"NodeName={host}", f"NodeName={host} NodeAddr=127.0.0.1") + " State=UNKNOWN"
    )


def slurm_conf(root: Path, host: str, munge_socket: Path) -> str:
    """The test cluster's configuration. The timeouts are long and jobs are never requeued:
    on a loaded 2-core machine a slow slurmd must not get the node declared lost and a running
    job started a second time beside its first attempt's processes."""
    return f"""\
ClusterName=apertustest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=30
SlurmdTimeout=1200
MessageTimeout=60
JobRequeue=0
MinJobAge=3600
{node_definition(host)}
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check)

    def query(self, *command: str) -> str:
        """A read-only command's output, retried as the launcher retries its queries (a busy
        slurmctld drops connections)."""
        return slurm_query(list(command), env=self.env)

    def job(self, job_id: str) -> dict[str, str]:
        """Slurm's record of a job (``scontrol show job -o``) as a dict."""
        line = self.query("scontrol", "show", "job", "-o", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def jobs_named(self, name: str) -> list[str]:
        out = self.query("squeue", "-h", "-t", "all", "-n", name, "-o", "%i").split()
        return sorted(out, key=int)

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        """Wait for ``job_id`` to end; its final record."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.job(job_id)
            if record.get("JobState") in FINAL_STATES:
                return record
            time.sleep(1)
        raise AssertionError(f"job {job_id} did not end within {timeout} s: {self.job(job_id)}")

    def logs(self) -> str:
        return "".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}\n" for p in sorted(self.root.glob("*.log"))
        )


def _start(cluster: Cluster, *command: str) -> None:
    cluster.daemons.append(
        subprocess.Popen(
            command, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
    )


def _wait_idle(cluster: Cluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(d.poll() is not None for d in cluster.daemons):
            raise RuntimeError(f"a Slurm daemon exited at start-up\n{cluster.logs()}")
        state = cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the node is not idle after {timeout} s\n{cluster.logs()}")


def _stop(cluster: Cluster) -> None:
    cluster.run("scancel", "--user", "root", check=False)
    for daemon in reversed(cluster.daemons):  # slurmd, slurmctld, then munged
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[Cluster]:
    ensure_slurm_installed()
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = root / "munge" / "munge.socket"
    host = socket.gethostname().split(".")[0]
    (root / "slurm.conf").write_text(slurm_conf(root, host, munge_socket))
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    env["PATH"] = f"/usr/sbin:/sbin:{env.get('PATH', '/usr/bin:/bin')}"
    cluster = Cluster(root=root, env=env)
    try:
        _start(
            cluster,
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={munge_socket}",
            f"--pid-file={root}/munge/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munge/munged.seed",
        )
        deadline = time.monotonic() + 30
        while not munge_socket.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        _start(cluster, "slurmctld", "-D", "-f", str(root / "slurm.conf"))
        _start(cluster, "slurmd", "-D", "-f", str(root / "slurm.conf"))
        _wait_idle(cluster)
        yield cluster
    finally:
        _stop(cluster)
