"""``hypha up`` / ``hypha down``: a whole cluster on this machine, as plain
processes (no containers), kept running by a supervisor.

Nodes bind port 0; the supervisor reads each node's ready file and passes the
addresses it needs to the nodes started after it with ``--set`` overrides, so
configs never hold stale ports.

Start order: gateway gw0, gateway gw1 (federated with gw0, DHT bootstrapped
through it), data node, scheduler, workers. Stop order is the reverse; each
node gets SIGTERM, then SIGKILL after a grace period.

A node that exits on its own (a crash, a SIGKILL, the OOM killer) is started
again on the address it had, as ``restart: unless-stopped`` does in the
compose file: the scheduler resumes its jobs, a worker re-attaches, a gateway
is found again at its old address. One that keeps exiting (``RESTART_LIMIT``
times within ``RESTART_WINDOW_S``) is left down and reported.

``hypha down`` signals only pids that are still the processes ``cluster.json``
recorded (``hypha.client.cluster``). A file whose supervisor and nodes are all
gone is stale: ``down`` says so, removes it, signals nothing and exits 1
(nothing was running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from hypha.client.cluster import Cluster, alive, as_int, process_start, role_command
from hypha.fsutil import write_atomic

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
#: A node that exits this many times within the window is in a crash loop: left down.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0


def _has_key(config: Path, role: str, key: str) -> bool:
    """Whether the role's own section of ``config`` has ``key``.

    Read from the file the role's ``init`` wrote (every key of its settings,
    the unset optional ones commented out), not from the role's settings
    class: the client does not import other roles.
    """
    with config.open("rb") as file:
        section = tomllib.load(file).get(role)
    return isinstance(section, dict) and key in section


class Supervisor:
    """Starts the nodes in order, keeps them, and stops them all on a signal."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self._started_with: dict[str, tuple[str, list[str]]] = {}
        self._stopping = False

    def start_node(self, name: str, role: str, overrides: list[str]) -> dict[str, Any]:
        self._started_with[name] = (role, list(overrides))
        cluster = self.cluster
        config = cluster.ensure_config(name, role)
        logs = cluster.state_dir / "logs"
        run = cluster.state_dir / "run"
        logs.mkdir(parents=True, exist_ok=True)
        run.mkdir(parents=True, exist_ok=True)
        ready = run / f"{name}.ready"
        ready.unlink(missing_ok=True)
        argv = [
            *cluster.launchers.get(name, []),
            *role_command(role),
            "run",
            "--config",
            str(config),
            "--ready-file",
            str(ready),
        ]
        for item in [*overrides, *cluster.overrides.get(role, []), *cluster.overrides.get(name, [])]:
            argv += ["--set", item]
        log_path = logs / f"{name}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready within {READY_TIMEOUT_S:.0f}s; see {log_path}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        info.update(pid=proc.pid, started=process_start(proc.pid), log=str(log_path), config=str(config))
        self.info[name] = info
        return info

    def start_all(self) -> None:
        cluster = self.cluster
        cluster.ensure_pki()
        cluster.ensure_configs(cluster.node_names())
        cluster.data_dir.mkdir(parents=True, exist_ok=True)
        cluster.models_dir.mkdir(parents=True, exist_ok=True)
        gw0 = self.start_node("gw0", "gateway", [])
        gw1 = self.start_node(
            "gw1",
            "gateway",
            [
                f"gateway.peers={json.dumps([gw0['address']])}",
                f"gateway.dht_bootstrap={json.dumps([gw0['dht']])}",
            ],
        )
        gateways = json.dumps([gw0["address"], gw1["address"]])
        dht = json.dumps([gw0["dht"], gw1["dht"]])
        self.start_node(
            "data0",
            "data",
            [
                f"net.gateways={gateways}",
                f"data.dht_bootstrap={dht}",
                f"data.data_dir={json.dumps(str(cluster.data_dir))}",
            ],
        )
        for name, role in cluster.node_names()[3:]:
            overrides = [f"net.gateways={gateways}"]
            if _has_key(cluster.config_path(name), role, "dht_bootstrap"):
                overrides.append(f"{role}.dht_bootstrap={dht}")
            if role == "worker":
                # All workers share this machine: split its cores, and let jobs use models
                # saved under the state dir (``model.local_path``), e.g. the demo's.
                threads = max(1, (os.cpu_count() or 1) // max(1, cluster.workers))
                models = json.dumps([str(cluster.models_dir.resolve())])
                overrides += [
                    f"worker.jobs.threads_per_job={threads}",
                    f"worker.jobs.local_model_roots={models}",
                ]
            overrides.append(f"state_dir={json.dumps(str(cluster.state_dir / 'nodes' / name))}")
            self.start_node(name, role, overrides)
        self.write_state()

    def write_state(self) -> None:
        state = {
            "supervisor": os.getpid(),
            "supervisor_started": process_start(os.getpid()),
            "state_dir": str(self.cluster.state_dir.resolve()),
            "pki": str(self.cluster.pki_dir.resolve()),
            "nodes": self.info,
        }
        write_atomic(self.cluster.state_file, json.dumps(state, indent=2).encode(), mode=0o644)

    def restart_node(self, name: str) -> dict[str, Any]:
        """Stop ``name`` (if it still runs) and start it again as before; its state dir is kept.

        It comes back on the ports it had, as a machine that reboots keeps its
        address: the other nodes were started with those addresses (gateways,
        DHT bootstrap) and would otherwise never find it again.
        """
        role, overrides = self._started_with[name]
        stop_process(self.procs[name])
        previous = self.info.get(name, {})
        pinned = list(overrides)
        if previous.get("address"):
            pinned.append(f"net.listen={json.dumps(previous['address'])}")
        if role == "gateway" and previous.get("dht"):
            pinned.append(f"gateway.dht_port={int(str(previous['dht']).rsplit(':', 1)[1])}")
        info = self.start_node(name, role, pinned)
        self._started_with[name] = (role, overrides)
        self.write_state()
        return info

    def stop_all(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for name in reversed(list(self.procs)):
            stop_process(self.procs[name])
        self.cluster.state_file.unlink(missing_ok=True)

    def watch(self) -> int:
        """Block until a signal (or a node dies: report it, keep the rest up)."""
        stop = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        given_up: set[str] = set()
        exits: dict[str, list[float]] = {}
        while not stop:
            for name, proc in list(self.procs.items()):
                if proc.poll() is None or name in given_up:
                    continue
                now = time.monotonic()
                recent = [t for t in exits.get(name, []) if now - t < RESTART_WINDOW_S] + [now]
                exits[name] = recent
                said = f"hypha up: {name} exited with {proc.returncode}; see {self.info[name]['log']}"
                if len(recent) > RESTART_LIMIT:
                    given_up.add(name)
                    print(
                        f"{said}; {len(recent)} exits within {RESTART_WINDOW_S:.0f} s, left down",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                print(f"{said}; restarting it", file=sys.stderr, flush=True)
                try:
                    self.restart_node(name)
                except RuntimeError as err:  # it did not come up: counted, tried again next time round
                    print(f"hypha up: {name} did not restart: {err}", file=sys.stderr, flush=True)
            time.sleep(0.2)  # supervising children: poll their exit status
        self.stop_all()
        return 0


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def up(state_dir: Path, workers: int, *, quiet: bool = False) -> int:
    cluster = Cluster(state_dir, workers)
    if cluster.running():
        print(
            f"hypha up: a cluster is already running from {state_dir} (hypha down stops it)", file=sys.stderr
        )
        return 1
    supervisor = Supervisor(cluster)
    try:
        supervisor.start_all()
    except (RuntimeError, OSError) as err:
        supervisor.stop_all()
        print(f"hypha up: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        supervisor.stop_all()
        return 130
    if not quiet:
        print(f"cluster up from {state_dir.resolve()} (Ctrl-C or `hypha down` stops it)")
        for name, info in supervisor.info.items():
            print(f"  {name:<10} {info['role']:<9} {info['address']:<22} log: {info['log']}")
        print(f"  client certificates: --certs {cluster.pki_dir.resolve()} --name client", flush=True)
    return supervisor.watch()


def down(state_dir: Path, timeout_s: float = 30.0) -> int:
    cluster = Cluster(state_dir)
    state = cluster.read_state()
    if state is None:
        print(f"hypha down: no cluster state in {state_dir}", file=sys.stderr)
        return 1
    # Only pids that are still the processes the file recorded (see the module's docstring).
    supervisor = as_int(state.get("supervisor")) if cluster.supervisor_alive(state) else 0
    nodes = cluster.live_nodes(state)
    if not supervisor and not nodes:
        cluster.state_file.unlink(missing_ok=True)
        print(
            f"hypha down: {cluster.state_file} is stale: neither its supervisor (pid "
            f"{as_int(state.get('supervisor'))}) nor any of its nodes is running any more; "
            "removed it, signalled nothing",
            file=sys.stderr,
        )
        return 1
    if supervisor:
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.1)  # another process's exit: nothing to wait on but its pid
    # Whatever is left (the supervisor was killed, or did not finish): stop the nodes directly.
    for pid in cluster.live_nodes(state).values():
        try:
            os.killpg(pid, signal.SIGTERM)  # each node leads its own session (start_new_session)
        except ProcessLookupError:
            pass
    cluster.state_file.unlink(missing_ok=True)
    print("cluster stopped")
    return 0
