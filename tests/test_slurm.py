"""launch/slurm.sbatch on a real Slurm: a controller and two node daemons (n1, n2) started on this host by the
fixture (`make slurm` installs Debian's slurm-wlm), stopped by PID at the end. One node of 2 processes and two
nodes of 1 train bitwise what `accelerate launch` with 2 processes trains; `scancel --signal=TERM` stops a job with
a checkpoint, and the job requeues itself, resumes from it and ends COMPLETED."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (LAUNCHERS_RUN, ROOT, assert_bitwise_equal_models, environment, free_port, read_metrics, tiny_args,
                     train_losses)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess,
              pytest.mark.skipif(torch.cuda.is_available(), reason="backend auto would train on the GPU here")]

SBATCH = ROOT / "launch" / "slurm.sbatch"
NODES = ("n1", "n2")


class LocalSlurm:
    """slurmctld and one slurmd per node, each in the foreground of its own process (-D), on free ports, with
    auth/none: everything under ``folder``, nothing of the host's Slurm touched."""

    def __init__(self, folder: Path):
        self.folder, self.daemons = folder, []
        self.conf = folder / "slurm.conf"
        for sub in ("state", *(f"spool/{n}" for n in NODES), "log"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        nodes = "".join(f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={free_port()} CPUs=2 "
                        "State=UNKNOWN\n" for n in NODES)
        self.conf.write_text(f"""ClusterName=test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=600
{nodes}PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "LocalSlurm":
        self.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        time.sleep(1)
        for node in NODES:
            self.daemons.append(subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(self.conf)], env=self.env,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while self.command("sinfo", "-h", "-o", "%T", check=False).split() != ["idle"]:
            assert time.monotonic() < deadline, (self.folder / "log" / "slurmctld.log").read_text()[-3000:]
            assert all(d.poll() is None for d in self.daemons), "a Slurm daemon exited at start"
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        """Jobs first (their processes belong to slurmstepd, not to the daemons), then the daemons."""
        self.command("scancel", "--partition=test", "--full", check=False)
        deadline = time.monotonic() + 60
        while self.command("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for daemon in self.daemons:
            daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()

    def command(self, *cmd: str, check: bool = True) -> str:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 or not check, proc.stderr
        return proc.stdout

    def submit(self, nodes: int, per_node: int, args, env: dict) -> str:
        """sbatch the template from the clone's root; the job id."""
        log = self.folder / "jobs" / "%j.out"
        log.parent.mkdir(exist_ok=True)
        proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", f"--output={log}", str(SBATCH), *args],
                              cwd=ROOT, env={**env, "SLURM_CONF": str(self.conf), "PROCESSES_PER_NODE": str(per_node),
                                             "PYTHON_ENV": sys.prefix},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def wait(self, job: str, timeout: float = 600) -> tuple:
        """(JobState, the batch script's exit status, its output) once the job ended."""
        deadline = time.monotonic() + timeout
        while self.command("squeue", "-h", "-j", job, check=False).strip():
            assert time.monotonic() < deadline, f"job {job} still running"
            time.sleep(0.5)
        fields = dict(f.split("=", 1) for f in self.command("scontrol", "show", "job", job).split() if "=" in f)
        return fields["JobState"], int(fields["ExitCode"].split(":")[0]), self.output(job)

    def output(self, job: str) -> str:
        # Both nodes write to it at once: a progress bar's character can be cut in two.
        return (self.folder / "jobs" / f"{job}.out").read_text(errors="replace")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
    assert not missing, f"{missing} not found: make slurm installs Debian's slurm-wlm"
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("nodes, per_node", [(1, 2), (2, 1)])
def test_a_slurm_job_trains_what_accelerate_launch_does(nodes, per_node, slurm, two_process_run, tiny_model, easy_data,
                                                        hf_home, tmp_path):
    out = tmp_path / "out"
    job = slurm.submit(nodes, per_node, tiny_args(tiny_model, easy_data, out, *LAUNCHERS_RUN), environment(hf_home))
    state, status, said = slurm.wait(job)
    assert (state, status) == ("COMPLETED", 0), said[-4000:]
    assert f"slurm job {job}: {nodes} node(s)" in said and "num_processes: 2" in said
    assert json.loads((out / "summary.json").read_text())["num_processes"] == 2
    assert_bitwise_equal_models(two_process_run, out)
    assert train_losses(out) == train_losses(two_process_run)


def test_a_job_stopped_by_scancel_term_requeues_itself_resumes_and_completes(slurm, tiny_model, easy_data, hf_home,
                                                                             tmp_path):
    """scancel --signal=TERM: every worker saves a checkpoint and says "preempted: ..." (torchrun's agent one line,
    no traceback); the job requeues itself
    (the same job id, its log appended to), resumes from that checkpoint and ends COMPLETED with status 0, having
    trained every step once: the weights and losses of the run that was never stopped."""
    out, whole = tmp_path / "out", tmp_path / "whole"
    steps = ["train.max_steps=300", "train.log_every=1", "train.cpu_threads=1", "train.batch_size=4"]
    job = slurm.submit(2, 1, tiny_args(tiny_model, easy_data, out, *steps), environment(hf_home))
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:  # 3 steps trained
        running = slurm.command("squeue", "-h", "-j", job, check=False).strip()
        assert running and time.monotonic() < deadline, slurm.output(job)[-3000:]
        time.sleep(0.2)
    slurm.command("scancel", "--signal=TERM", job)
    state, status, said = slurm.wait(job)
    assert (state, status) == ("COMPLETED", 0), said[-4000:]
    assert "preempted: stopped by SIGTERM after step " in said, said[-4000:]
    stopped_at = int(said.split("preempted: stopped by SIGTERM after step ")[1].split(";")[0])
    assert 3 <= stopped_at < 300
    assert f"slurm job {job}: preempted with a checkpoint saved; requeued" in said
    # torchrun's agent, signalled too, says one line on each node instead of its SignalException traceback.
    assert said.count("launch: torchrun's agent stopped by SIGTERM") == 2 and "Traceback" not in said, said[-4000:]
    assert f"slurm job {job}: 2 node(s)" in said and "requeued 1 time(s)" in said
    assert f"resuming from {out / 'checkpoints' / f'step_{stopped_at}'}: step {stopped_at}" in said
    assert "Restarts=1" in slurm.command("scontrol", "show", "job", job)
    assert json.loads((out / "summary.json").read_text())["train"]["steps"] == 300
    again = slurm.submit(2, 1, tiny_args(tiny_model, easy_data, whole, *steps), environment(hf_home))
    assert slurm.wait(again)[:2] == ("COMPLETED", 0)
    assert_bitwise_equal_models(whole, out)
    assert train_losses(out) == train_losses(whole)
