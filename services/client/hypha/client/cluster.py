"""The state dir of a local cluster (``hypha up``): its layout, PKI, node configs,
and ``cluster.json``, the record of what runs.

The state dir holds everything: a PKI made on first run (and reused), one
config per node, logs, and ``cluster.json`` (the supervisor's pid and each
node's pid, address and log, each pid with its process's start time).
``hypha.client.supervisor`` starts and keeps the nodes and writes that file.

A pid from ``cluster.json`` counts as running only while it is still the
process the file recorded (``_is_recorded``): a pid is reused once its process
exits, so a file left behind by a supervisor that was killed could otherwise
name anyone's process. The process's start time (``/proc/PID/stat``, clock
ticks since boot) must equal the one recorded; a file without start times
(written before they were recorded) is trusted only for a process that
started before the file was written. Linux only (``/proc``), like the rest of
the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypha.pki import certs

#: The command-line module of each role a cluster runs (``python -m MODULE``): the client starts
#: the other roles as processes and never imports them.
ROLE_MODULES = {
    "gateway": "hypha.gateway.cli",
    "scheduler": "hypha.scheduler.cli",
    "worker": "hypha.worker.cli",
    "data": "hypha.data.cli",
}
#: How long one role's ``init`` may take (an interpreter start and the role's settings module).
INIT_TIMEOUT_S = 60.0
DEFAULT_STATE_DIR = Path(os.environ.get("HYPHA_STATE_DIR", ".hypha"))


@dataclass
class Cluster:
    state_dir: Path
    workers: int = 3
    #: Extra ``--set KEY=VALUE`` overrides by node name or by role (a name's come after its role's),
    #: e.g. ``{"worker": ["worker.lease_ttl_s=5"], "worker2": ["net.external_addresses=[...]"]}``.
    overrides: dict[str, list[str]] = field(default_factory=dict)
    #: What a node's command runs under, by node name: e.g. ``["ip", "netns", "exec", NS]`` puts
    #: that node in another network namespace (``benchmarks/wan.py``'s capped sites). It must
    #: exec the command, so the pid ``cluster.json`` records stays the node's.
    launchers: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every path derived from here reaches other processes (node configs, worker work dirs,
        # the bridge sockets executors dial from their own working directory): anchor it now.
        self.state_dir = self.state_dir.expanduser().absolute()

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def models_dir(self) -> Path:
        """Models jobs of this cluster may name by local path."""
        return self.state_dir / "models"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def node_names(self) -> list[tuple[str, str]]:
        names = [("gw0", "gateway"), ("gw1", "gateway"), ("data0", "data"), ("scheduler", "scheduler")]
        names += [(f"worker{i}", "worker") for i in range(self.workers)]
        return names

    # ---- first run: PKI and configs --------------------------------------

    @property
    def ca_dir(self) -> Path:
        """The CA keys (and certificates): no node config names this dir, no executor sees it."""
        return self.state_dir / "ca"

    def ensure_pki(self) -> None:
        """Root and org CA in ``ca/`` (0700), node certificates and keys in ``pki/``.

        NOTE: the CA keys mint any certificate, an admin's included, so they
        never sit beside the nodes' files (a state dir from before this split
        has its CA keys moved out of ``pki/``). Only the CA certificates,
        which are public, are copied into ``pki/``.
        """
        pki, ca = self.pki_dir, self.ca_dir
        for folder in (pki, ca):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)
        for name in ("root-ca-key.pem", "local-ca-key.pem"):
            if (pki / name).exists():
                (pki / name).replace(ca / name)
        for name in ("root-ca-cert.pem", "local-ca-cert.pem"):
            if (pki / name).exists() and not (ca / name).exists():
                shutil.copyfile(pki / name, ca / name)
        root_cert, root_key = ca / "root-ca-cert.pem", ca / "root-ca-key.pem"
        if not root_key.exists():
            certs.make_root(ca)
        org_cert, org_key = ca / "local-ca-cert.pem", ca / "local-ca-key.pem"
        if not org_key.exists():
            certs.make_org(root_cert, root_key, "local", ca)
        for cert in (root_cert, org_cert):
            shutil.copyfile(cert, pki / cert.name)
        wanted = [*self.node_names(), ("client", "client"), ("admin", "admin")]
        for name, role in wanted:
            if not (pki / f"{name}-cert.pem").exists():
                # Loopback SANs: every node of a local cluster is dialled on 127.0.0.1.
                certs.make_node(org_cert, org_key, role, name, pki, loopback=True)

    def config_path(self, name: str) -> Path:
        return self.state_dir / "config" / f"{name}.toml"

    def ensure_config(self, name: str, role: str) -> Path:
        """``name``'s config, written by its role's own ``init`` on first use."""
        self.ensure_configs([(name, role)])
        return self.config_path(name)

    def ensure_configs(self, nodes: list[tuple[str, str]]) -> None:
        """Write the configs of ``nodes`` (name, role) not written yet, each by its role's ``init``.

        Each role's command runs as its own process (``python -m hypha.<role>.cli init``),
        as ``hypha up`` runs the nodes: the client never imports another role. They run
        side by side: a first ``hypha up`` waits for the slowest one, not for their sum.
        """
        started = []
        for name, role in nodes:
            path = self.config_path(name)
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            argv = [*role_command(role), "init", "--name", name, "--certs", str(self.pki_dir)]
            argv += ["--out", str(path)]
            started.append((name, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        failed = []
        for name, proc in started:
            try:
                said, _ = proc.communicate(timeout=INIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                said, _ = proc.communicate()
            if proc.returncode != 0:
                failed.append(f"{name}: {said.decode(errors='replace').strip() or f'exit {proc.returncode}'}")
        if failed:
            raise RuntimeError(f"could not write the config of {'; '.join(failed)}")

    # ---- running -----------------------------------------------------------

    def read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> dict[str, Any] | None:
        """The live cluster's state, or None (a stale state file is ignored)."""
        state = self.read_state()
        if state and self.supervisor_alive(state):
            return state
        return None

    def written_at(self) -> float:
        """When ``cluster.json`` was last written (0 when it is not there)."""
        try:
            return self.state_file.stat().st_mtime
        except OSError:
            return 0.0

    def supervisor_alive(self, state: dict[str, Any]) -> bool:
        """Whether the supervisor ``state`` names is still that process (not a reused pid)."""
        return _is_recorded(
            as_int(state.get("supervisor")), state.get("supervisor_started"), self.written_at()
        )

    def live_nodes(self, state: dict[str, Any]) -> dict[str, int]:
        """The nodes ``state`` names whose pids are still those processes: name → pid."""
        written_at = self.written_at()
        nodes = state.get("nodes")
        live = {}
        for name, info in (nodes if isinstance(nodes, dict) else {}).items():
            if isinstance(info, dict) and _is_recorded(
                as_int(info.get("pid")), info.get("started"), written_at
            ):
                live[str(name)] = as_int(info.get("pid"))
        return live


def role_command(role: str) -> list[str]:
    """The command line that runs ``role``'s CLI with this interpreter.

    ``-P``: the current dir (where keys may lie) is no import path, so no
    Landlock sandbox grants it.
    """
    return [sys.executable, "-P", "-m", ROLE_MODULES[role]]


def as_int(value: Any) -> int:
    """An integer field of ``cluster.json`` (anything else: 0, which names no process)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None when it is gone (or no ``/proc``)."""
    try:
        # Field 22 of /proc/PID/stat; the name (field 2) may hold spaces and ")", so split after it.
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_time() -> float:
    """The system's boot time (epoch seconds), from ``/proc/stat``."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("/proc/stat has no btime")


def _is_recorded(pid: int, recorded_start: Any, written_at: float) -> bool:
    """Whether ``pid`` is alive and still the process ``cluster.json`` recorded.

    With a recorded start time the process's must equal it; without one (a file
    from before they were recorded) the process must have started before the
    file was written (1 s of slack: ticks and mtimes round differently).
    """
    if not alive(pid):
        return False
    started = process_start(pid)
    if started is None:
        return False  # cannot tell whose process it is: do not touch it
    if isinstance(recorded_start, int) and not isinstance(recorded_start, bool):
        return started == recorded_start
    try:
        started_at = _boot_time() + started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return False
    return started_at <= written_at + 1.0


def alive(pid: int) -> bool:
    """Whether `pid` names a running process (a zombie does not count)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True
