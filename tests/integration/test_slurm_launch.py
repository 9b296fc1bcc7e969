"""ultra_launch.sh on a real single-node Slurm started on this host, running a short capture job.

The cluster lives entirely in a pytest temp dir: Debian's slurmctld and slurmd with munge (own
key, socket, pid and log files), loopback addresses and OS-picked ports, no cgroups
(proctrack/linuxproc, task/none, no accounting), SlurmUser=root. Nothing under /etc is used:
every client finds the cluster through SLURM_CONF. Each daemon runs in the foreground as a child
of this test and is stopped by its PID afterwards.

Binaries: found on PATH or in the standard sbin dirs. When they are missing the test fails,
naming the install command, on a host where it could install them (root with apt-get; `.ci/run`
installs them there), and skips only where they can be neither found nor installed.

The job: `ultra_launch.sh` with the tiny CPU capture recipe for 2 steps. Its Ray cluster binds
the head to 127.0.0.1 in a short temp dir and the driver joins it (RAY_ADDRESS). The test waits
for the job with a deadline (scontrol), then checks the job state, the metrics of both steps
(always-N, token_in_rate, nothing poisoned, exact logprobs), that the driver joined the job's
cluster, and that no Ray process of the job outlives it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nemo_rl.token_capture.verdict import ENGAGED, capture_verdict, read_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "srun", "scancel")
# Debian installs the daemons in sbin, which a non-login PATH may lack.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")
INSTALL_COMMAND = "apt-get install -y --no-install-recommends slurm-wlm munge"
STEPS = 2
ROLLOUTS_PER_STEP = 2 * 4  # grpo_base.yaml: 2 prompts x 4 generations
JOB_DEADLINE_S = 25 * 60  # a cold vLLM venv build plus the run; a warm run takes ~3 min
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _find(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN_DIRS))


def _binaries_or_skip() -> dict[str, str]:
    found = {name: _find(name) for name in DAEMONS + CLIENTS}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        installable = os.geteuid() == 0 and shutil.which("apt-get") is not None
        if installable:
            pytest.fail(f"Slurm binaries {missing} are missing but installable on this host: run `{INSTALL_COMMAND}` (.ci/run does)")
        pytest.skip(f"Slurm binaries {missing} are missing and cannot be installed here (needs root and apt-get)")
    return {name: path for name, path in found.items() if path is not None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalSlurm:
    root: Path
    conf: Path
    bins: dict[str, str]
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 30) -> str:
        proc = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{args} exit {proc.returncode}: {proc.stderr}"
        return proc.stdout

    def logs(self) -> str:
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name} (tail)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        # Reverse start order, each by the PID we started; a stuck daemon is killed after 30 s.
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)


def _start(slurm: LocalSlurm, name: str, args: list[str]) -> None:
    log = open(slurm.root / "log" / f"{name}.out", "w")
    slurm.procs[name] = subprocess.Popen(args, env=slurm.env, stdout=log, stderr=subprocess.STDOUT)
    log.close()


def _wait_until(what: str, check, deadline_s: float, slurm: LocalSlurm) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for name, proc in slurm.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode} while waiting for {what}\n{slurm.logs()}")
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out after {deadline_s:.0f}s waiting for {what}\n{slurm.logs()}")


def _write_conf(root: Path, host: str, munge_socket: Path) -> Path:
    cpus = os.cpu_count() or 1
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=nrltest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={munge_socket}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                # No cgroups on this machine kind: track processes by parentage, bind nothing.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=none",
                "ReturnToService=2",
                # Completed jobs stay visible to `scontrol show job` for this long.
                "MinJobAge=3600",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1024 State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    bins = _binaries_or_skip()
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "run", "munge"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    munge_socket = root / "munge" / "munge.socket"
    host = socket.gethostname().split(".")[0]
    conf = _write_conf(root, host, munge_socket)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    env["PATH"] = os.pathsep.join([str(Path(bins["sbatch"]).parent), env.get("PATH", "")])
    for var in ("SLURM_QOS", "SLURM_JOB_ID", "SLURM_JOBID", "RAY_ADDRESS"):  # no outer job or cluster leaks in
        env.pop(var, None)
    slurm = LocalSlurm(root=root, conf=conf, bins=bins, env=env)
    try:
        _start(slurm, "munged", [
            bins["munged"], "--foreground", "--force", f"--key-file={key}", f"--socket={munge_socket}",
            f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
            f"--seed-file={root / 'munge' / 'munged.seed'}",
        ])
        _wait_until("the munge socket", munge_socket.exists, 30, slurm)
        _start(slurm, "slurmctld", [bins["slurmctld"], "-D", "-f", str(conf)])
        _wait_until("slurmctld", lambda: subprocess.run(
            [bins["scontrol"], "ping"], env=env, capture_output=True, text=True, timeout=10).stdout.count("UP") >= 1, 60, slurm)
        _start(slurm, "slurmd", [bins["slurmd"], "-D", "-f", str(conf)])
        _wait_until("the node to be idle", lambda: slurm.run(bins["sinfo"], "-h", "-o", "%T").strip() == "idle", 60, slurm)
        yield slurm
    finally:
        slurm.stop()
    leftovers = [name for name, proc in slurm.procs.items() if proc.poll() is None]
    assert not leftovers, f"daemons still running after stop: {leftovers}"


def _job_fields(slurm: LocalSlurm, job_id: str) -> dict[str, str]:
    text = slurm.run(slurm.bins["scontrol"], "show", "job", "-o", job_id)
    return dict(re.findall(r"(\w+)=(\S*)", text))


def _wait_for_job(slurm: LocalSlurm, job_id: str, deadline_s: float) -> dict[str, str]:
    deadline = time.monotonic() + deadline_s
    while True:
        fields = _job_fields(slurm, job_id)
        if fields["JobState"] in TERMINAL_STATES:
            return fields
        if time.monotonic() > deadline:
            slurm.run(slurm.bins["scancel"], job_id)
            pytest.fail(f"job {job_id} still {fields['JobState']} after {deadline_s:.0f}s; cancelled\n{slurm.logs()}")
        time.sleep(5)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited while we looked, or not ours to read
        if text in cmdline and entry.name != str(os.getpid()):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_local_slurm_runs_a_batch_job_with_overlapping_steps(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    """The cluster itself: sbatch runs a script whose two concurrent `srun --overlap` steps both run."""
    script = tmp_path / "probe.sbatch"
    out = tmp_path / "probe.out"
    script.write_text(
        "#!/usr/bin/env bash\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n"
        f"#SBATCH --output={out}\nset -euo pipefail\n"
        'srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" sleep 2 &\n'
        'srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" echo "step on $(hostname -s)"\n'
        "wait\n"
    )
    job_id = local_slurm.run(local_slurm.bins["sbatch"], "--parsable", str(script)).strip().split(";")[0]
    fields = _wait_for_job(local_slurm, job_id, 60)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out.read_text() if out.exists() else fields
    assert out.read_text().splitlines() == [f"step on {socket.gethostname().split('.')[0]}"]


def test_ultra_launch_runs_a_capture_job_on_slurm(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launch_dir = tmp_path / "launch"
    # Short and unique: Ray's sockets live under it (AF_UNIX limit), and we look for its leftovers.
    ray_tmp = f"/tmp/nrl-t{secrets.token_hex(4)}"
    env = {
        **local_slurm.env,
        "NRL_LAUNCH_LOG_DIR": str(launch_dir),
        "NRL_RAY_HEAD_IP": "127.0.0.1",
        "NRL_RAY_TMPDIR": ray_tmp,
        "NRL_RAY_WAIT_TIMEOUT_S": "300",
        "WALLTIME": "00:30:00",
    }
    # The machine's uv cache (it holds every pinned wheel) instead of a per-job one, when uv is
    # known (`uv run` exports UV); the job falls back to a per-job cache otherwise.
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        env["UV_CACHE_DIR"] = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True,
                                             env={k: v for k, v in os.environ.items() if k != "UV_CACHE_DIR"}).stdout.strip()
    t0 = time.monotonic()
    submit = subprocess.run(
        ["bash", "ultra_launch.sh", "--job-name", "nrl-slurm-test", "--config", "examples/configs/grpo_capture_tiny_cpu.yaml",
         "--", f"grpo.max_num_steps={STEPS}", f"logger.log_dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )
    assert submit.returncode == 0, submit.stderr
    match = re.fullmatch(r"ultra_launch\.sh: submitted job (\d+); output (\S+); script (\S+)\n", submit.stdout)
    assert match, submit.stdout
    job_id, output = match.group(1), Path(match.group(2))
    assert output == launch_dir / f"nrl-slurm-test-{job_id}.out"

    fields = _wait_for_job(local_slurm, job_id, JOB_DEADLINE_S)
    print(f"[slurm test] job {job_id} {fields['JobState']} after {time.monotonic() - t0:.0f}s")
    job_log = output.read_text(errors="replace") if output.exists() else "<no job output>"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{job_log[-6000:]}\n{local_slurm.logs()}"

    # The launcher formed the cluster, and the driver joined it instead of starting its own.
    assert re.search(r"\[ray\] cluster ready: 1 nodes at 127\.0\.0\.1:\d+", job_log), job_log[-4000:]
    assert re.search(r"\[stack\] joined the Ray cluster at 127\.0\.0\.1:\d+ \(RAY_ADDRESS\)", job_log), job_log[-4000:]
    assert "Ray stopped; job exits with 0" in job_log

    lines = read_metrics(run_dir)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert line["rollouts/dispatched"] == ROLLOUTS_PER_STEP
        assert line["finalize/kept_rollouts"] + line["finalize/placeholders"] == ROLLOUTS_PER_STEP
        assert line["finalize/capture_poisoned_rollouts"] == 0
        assert line["finalize/text_root_calls"] >= 1  # served through capture
        assert line["finalize/token_in_rate"] >= 0.99
        assert line["token_mult_prob_error"] < 1.01
    assert capture_verdict(lines).status == ENGAGED

    # The job stopped its own Ray (and only it): nothing runs from its temp dir, which is gone.
    assert _processes_mentioning(ray_tmp) == []
    assert not os.path.exists(ray_tmp)
    token = launch_dir / f"nrl-slurm-test-{job_id}" / "ray_auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
