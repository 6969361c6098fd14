"""A compose project of the real docker-compose.yml, and the host's ``hypha`` CLI pointed at it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from testcontainers.compose import DockerCompose

ROOT = Path(__file__).resolve().parents[4]  # libs/testing/hypha/testing/compose.py
HYPHA = str(Path(sys.executable).parent / "hypha")
T = TypeVar("T")

#: A small DiLoCo job on the demo model and dataset the compose file provides.
JOB_TOML = """
[job]
name = "{name}"
dataset = "arithmetic"
rounds = {rounds}
samples_per_round = {samples}
min_batch_size = 16
max_batch_size = 16
quorum = 0.5
round_timeout_s = 60

[job.model]
local_path = "/models/tiny-gpt2"
type = "causal-lm"

[job.inner_optimizer]
learning_rate = 0.005

[job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

[job.resources]
num_workers = 2
"""


#: The scheduler's slice audit (one DEBUG line per slice a trainer finished) for chaos runs and tests.
SCHEDULER_DEBUG = """
services:
  scheduler:
    environment:
      HYPHA_LOG__LEVEL: debug
"""


def docker_ok() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_v2() -> bool:
    try:
        return (
            subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def eventually(check: Callable[[], T | None], timeout: float, what: str, interval: float = 1.0) -> T:
    """Poll ``check`` until it returns something truthy, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except Exception as err:  # a container mid-restart: try again until the deadline
            last = err
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval)  # polling with a deadline, not waiting for an effect


def state(job: dict[str, Any]) -> str:
    return str(job["state"]).lower().removeprefix("job_state_")


class _Project(DockerCompose):
    """DockerCompose with an explicit project name, so tests never touch a user's cluster."""

    project: str = ""

    @cached_property
    def compose_command_property(self) -> list[str]:
        cmd: list[str] = super().compose_command_property
        return [*cmd[:2], "-p", self.project, *cmd[2:]]


@dataclass
class Cluster:
    compose: DockerCompose
    certs: Path
    workdir: Path

    @classmethod
    @contextmanager
    def up(
        cls,
        workdir: Path,
        workers: int,
        profiles: list[str],
        *,
        project: str = "hyphatest",
        subnets: tuple[str, str] = ("10.241.0", "10.242.0"),
    ) -> Iterator[Cluster]:
        """The project ``PROJECT<pid>`` on its own subnets, its scheduler logging at DEBUG
        (the slice audit lines ``slices_exactly_once`` reads); down with its volumes after."""
        env = workdir / "compose.env"
        # Empty host ports: docker picks free ones (read back with `compose port`).
        # Own subnets, so a user's cluster (10.231/10.232) may run beside the tests.
        env.write_text(
            f"HYPHA_SCHEDULER_PORT=\nHYPHA_REST_PORT=\nHYPHA_SUBNET_PREFIX={subnets[0]}\n"
            f"HYPHA_EDGE_SUBNET_PREFIX={subnets[1]}\nHYPHA_WORKER_POOL=12\n"
        )
        override = workdir / "compose.override.yml"
        override.write_text(SCHEDULER_DEBUG)
        compose = _Project(
            context=ROOT,
            compose_file_name=["docker-compose.yml", str(override)],
            env_file=str(env),
            profiles=profiles,
        )
        compose.project = f"{project}{os.getpid()}"
        cluster = cls(compose, workdir / "certs", workdir)
        try:
            cluster.run(
                "up", "-d", "--wait", "--wait-timeout", "480", "--scale", f"worker={workers}", timeout=600
            )
            cluster.export_certs(workdir)
            yield cluster
        finally:
            try:
                logs = cluster.run("logs", "--no-color", "--tail", "200", check=False, timeout=60).stdout
                (workdir / "compose.log").write_text(logs)
                print(logs[-20000:])  # pytest shows it when a test or the fixture failed
            finally:
                cluster.run("down", "--volumes", "--timeout", "20", check=False, timeout=300)

    # ---- compose ------------------------------------------------------------------

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [*self.compose.compose_command_property, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
        return out

    def export_certs(self, into: Path) -> Path:
        """The README's command: ``docker compose run --rm -T pki export-client | tar -x``."""
        exported = subprocess.run(
            [*self.compose.compose_command_property, "run", "--rm", "-T", "pki", "export-client"],
            cwd=ROOT,
            capture_output=True,
            timeout=120,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=exported, check=True, timeout=60)
        return into / "certs"

    def containers(self, service: str, all_states: bool = False) -> list[str]:
        args = ["ps", "-q", *(["-a"] if all_states else []), service]
        return self.run(*args).stdout.split()

    def inspect(self, container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, check=True)
        info: dict[str, Any] = json.loads(out.stdout)[0]
        return info

    def exec(self, container: str, *argv: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
        """``docker exec`` (as the container's user, root for workers, unless ``user``)."""
        as_user = ["-u", user] if user else []
        return subprocess.run(
            ["docker", "exec", *as_user, container, *argv], capture_output=True, text=True, timeout=120
        )

    def health(self, container: str) -> str:
        state = self.inspect(container)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def peer_ids(self, service: str = "worker") -> dict[str, str]:
        """peer id -> container, read from each node's ready line."""
        found = {}
        for container in self.containers(service):
            logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True).stdout
            for line in logs.splitlines():
                if line.startswith('{"event": "ready"'):
                    found[json.loads(line)["peer_id"]] = container
        return found

    def worker_peer_ids(self) -> dict[str, str]:
        """peer id -> container for every worker, the relay-only one too where its profile is up."""
        services = ["worker", *(["worker-relay"] if "relay" in (self.compose.profiles or []) else [])]
        found: dict[str, str] = {}
        for service in services:
            found.update(self.peer_ids(service))
        return found

    def ready_name(self, container: str) -> str:
        """The certificate name the node in ``container`` serves as, from its ready line."""
        logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True).stdout
        names = [
            json.loads(line)["name"] for line in logs.splitlines() if line.startswith('{"event": "ready"')
        ]
        assert names, f"{container} logged no ready line"
        return str(names[-1])

    def worker_identity(self, container: str) -> str:
        """The one identity a worker container holds, checked from outside: its name.

        As root: /run/hypha/certs holds exactly NAME-{cert,key,trust}.pem, owned
        by uid 10001 (the directory 0700, the key 0600), and the pool at /pool
        is root's alone (0700); as uid 10001, what the worker and its jobs run
        as, the pool cannot even be listed.
        """
        listed = self.exec(container, "ls", "-A", "/run/hypha/certs")
        assert listed.returncode == 0, listed.stderr
        files = sorted(listed.stdout.split())
        assert len(files) == 3 and files[0].endswith("-cert.pem"), files
        name = files[0].removesuffix("-cert.pem")
        assert files == [f"{name}-cert.pem", f"{name}-key.pem", f"{name}-trust.pem"], files
        modes = self.exec(
            container, "stat", "-c", "%u %a", "/run/hypha/certs", f"/run/hypha/certs/{name}-key.pem", "/pool"
        )
        assert modes.stdout.split("\n")[:3] == ["10001 700", "10001 600", "0 700"], modes.stdout
        pool = self.exec(container, "ls", "/pool", user="10001")
        assert pool.returncode != 0 and "Permission denied" in pool.stderr, (pool.stdout, pool.stderr)
        return name

    def worker_process(self, container: str) -> tuple[int, dict[str, str]]:
        """The pid of ``hypha-worker run`` in ``container`` and its /proc status fields (read as root)."""
        find = (
            "import os, pathlib\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try: argv = pathlib.Path(f'/proc/{pid}/cmdline').read_bytes().split(b'\\0')\n"
            "    except OSError: continue  # gone meanwhile\n"
            "    if any(a.endswith(b'/hypha-worker') for a in argv) and b'run' in argv:\n"
            "        print(pid)\n"
        )
        found = self.exec(container, "python3", "-c", find)
        pids = found.stdout.split()
        assert len(pids) == 1, (pids, found.stderr)
        pid = pids[0]
        status = self.exec(container, "cat", f"/proc/{pid}/status").stdout
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        return int(pid), {key: value.strip() for key, value in fields.items()}

    def port(self, service: str, port: int) -> int:
        return int(self.run("port", service, str(port)).stdout.strip().rsplit(":", 1)[1])

    # ---- the host's hypha CLI -----------------------------------------------------

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.port('scheduler', 7200)}"

    def hypha(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [HYPHA, "--scheduler", self.scheduler, "--certs", str(self.certs), "--name", "client", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.workdir)

    def submit(self, name: str, rounds: int, samples: int = 256) -> str:
        job = self.workdir / f"{name}.toml"
        job.write_text(JOB_TOML.format(name=name, rounds=rounds, samples=samples))
        return self.submit_file(job)

    def submit_file(self, job: Path) -> str:
        """``hypha submit JOB.toml``: the job id (files the job ships lie beside it)."""
        out = self.hypha("--output", "json", "submit", str(job))
        assert out.returncode == 0, out.stderr
        job_id: str = json.loads(out.stdout)["job_id"]
        return job_id

    def job(self, job_id: str) -> dict[str, Any]:
        out = self.hypha("--output", "json", "status", job_id)
        assert out.returncode in (0, 1), out.stderr
        job: dict[str, Any] = json.loads(out.stdout)
        return job

    def wait_job(
        self, job_id: str, timeout: float = 300, until: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        def done(job: dict[str, Any]) -> bool:
            return state(job) in ("succeeded", "failed", "cancelled")

        check = until or done
        return eventually(
            lambda: (lambda j: j if check(j) else None)(self.job(job_id)), timeout, f"job {job_id}"
        )

    def workers(self) -> list[dict[str, Any]]:
        out = self.hypha("--output", "json", "workers")
        assert out.returncode == 0, out.stderr
        views: list[dict[str, Any]] = json.loads(out.stdout)
        return views
