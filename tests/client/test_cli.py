"""The ``hypha`` CLI as users run it (a subprocess) against a real scheduler API over mTLS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from hypha.client import cli
from hypha.client.cluster import process_start
from hypha.client.commands.jobs import resolve_local_paths
from hypha.jobfile import parse_job_toml
from hypha.net.server import NodeServer
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.store import LogEntry, WorkerMetric
from hypha.v1 import scheduler_pb2_grpc
from tests.conftest import Pki
from tests.scheduler.test_jobfile import INFERENCE
from tests.scheduler.test_servicer import DILOCO_TOML, TASK_TOML, Served, serve_api


@pytest.fixture
async def served(pki: Pki, tmp_path: Path) -> AsyncIterator[Served]:
    async with serve_api(pki, tmp_path) as s:
        yield s


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPHA_")}
    env["HYPHA_STATE_DIR"] = str(tmp_path / "no-cluster")  # never pick up a real local cluster
    return env


async def start(
    served: Served | None, pki: Pki, tmp_path: Path, *args: str, name: str = "client"
) -> asyncio.subprocess.Process:
    flags = ["--scheduler", served.address, "--certs", str(pki.dir), "--name", name] if served else []
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hypha.client.cli",
        *flags,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=_env(tmp_path),
    )


async def hypha(
    served: Served | None, pki: Pki, tmp_path: Path, *args: str, name: str = "client"
) -> tuple[int, str, str]:
    proc = await start(served, pki, tmp_path, *args, name=name)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_version_and_usage_errors_exit_2_with_one_line(pki: Pki, tmp_path: Path) -> None:
    code, out, _ = await hypha(None, pki, tmp_path, "version")
    assert code == 0 and out.startswith("hypha-ml ")
    code, _, err = await hypha(None, pki, tmp_path, "status")
    assert (
        code == 2
        and err == "hypha: error: no scheduler: give --scheduler HOST:PORT (or set HYPHA_SCHEDULER)\n"
    )
    code, _, err = await hypha(
        None, pki, tmp_path, "--scheduler", "127.0.0.1:1", "--certs", str(tmp_path), "status"
    )
    assert code == 2 and err.startswith("hypha: error: client certificate: tls.cert: file not found")
    code, _, err = await hypha(None, pki, tmp_path, "frobnicate")
    assert code == 2 and "invalid choice" in err


async def test_submit_status_and_cancel_with_exit_codes_and_json(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    job_file = tmp_path / "job.toml"
    job_file.write_text(TASK_TOML)
    code, out, _ = await hypha(served, pki, tmp_path, "submit", str(job_file), "--output", "json")
    assert code == 0
    job = json.loads(out)
    assert job["state"] == "pending" and job["kind"] == "task" and job["name"] == "hello"
    job_id = job["job_id"]

    code, out, _ = await hypha(served, pki, tmp_path, "--output", "json", "status", job_id)
    assert code == 0 and json.loads(out)["state"] == "pending"
    code, out, _ = await hypha(served, pki, tmp_path, "status")
    assert code == 0 and out.splitlines()[0].split() == ["JOB", "KIND", "STATE", "PROGRESS", "AGE", "NAME"]
    assert job_id in out and "pending" in out
    code, out, _ = await hypha(served, pki, tmp_path, "status", "--state", "running")
    assert code == 0 and out.strip() == "no jobs"

    bad = tmp_path / "bad.toml"
    bad.write_text(DILOCO_TOML.replace("rounds = 4", 'rounds = "four"'))
    code, _, err = await hypha(served, pki, tmp_path, "submit", str(bad))
    assert code == 2 and err == f"hypha: error: {bad}: job.rounds: must be an integer\n"
    code, _, err = await hypha(served, pki, tmp_path, "status", "nope")
    assert code == 1 and err == "hypha: error: NOT_FOUND: no such job: nope\n"

    code, out, _ = await hypha(served, pki, tmp_path, "cancel", job_id)
    assert code == 0 and out == f"cancelled {job_id}\n"
    code, _, err = await hypha(served, pki, tmp_path, "cancel", job_id)
    assert code == 1 and err.startswith("hypha: error: FAILED_PRECONDITION: job ")
    code, out, _ = await hypha(served, pki, tmp_path, "watch", job_id)
    assert code == 1 and "cancelled" in out  # watch exits with the job's outcome
    code, _, err = await hypha(served, pki, tmp_path, "cancel")
    assert code == 2 and "give a job id or --all" in err
    code, _, err = await hypha(served, pki, tmp_path, "status", name="worker")
    assert code == 1 and err.startswith("hypha: error: PERMISSION_DENIED: role worker may not call")


async def test_watch_shows_rounds_loss_and_throughput_and_exits_0_on_success(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    job = await served.api.submit_spec(pki.tls("client").identity, parse_job_toml(DILOCO_TOML))
    proc = await start(served, pki, tmp_path, "watch", job.job_id, "--output", "json")
    assert proc.stdout is not None
    first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    assert first["job"]["state"] == "pending"

    store = served.store
    await store.transition(job.job_id, JobState.ALLOCATING)
    await store.transition(job.job_id, JobState.RUNNING, workers=["w1", "w2"])
    metrics = [WorkerMetric("w1", 30.0, 300, 2.5, 8), WorkerMetric("w2", 10.0, 100, 2.7, 8)]
    await store.update(job.job_id, round=2, loss=2.6, worker_metrics=metrics, message="round 1 complete")
    await store.transition(job.job_id, JobState.SUCCEEDED, reason="done")
    raw, _ = await asyncio.wait_for(proc.communicate(), 30)

    events = [json.loads(line) for line in raw.decode().splitlines()]
    assert proc.returncode == 0
    assert [e["job"]["state"] for e in events] == ["allocating", "running", "running", "succeeded"]
    progress = events[2]
    assert (progress["job"]["round"], progress["job"]["rounds"], progress["job"]["loss"]) == (2, 4, 2.6)
    assert [(w["worker_id"], w["samples_per_second"]) for w in progress["workers"]] == [
        ("w1", 30.0),
        ("w2", 10.0),
    ]

    # Plain text (not a terminal): one line per event.
    code, text, _ = await hypha(served, pki, tmp_path, "watch", job.job_id)
    assert code == 0 and text.count("\n") == 1 and "succeeded round 2/4 loss 2.6000" in text


async def test_watch_outlives_a_scheduler_restart_and_ends_with_the_job(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    # The scheduler resumes its jobs after a restart; a watch must not end when it goes away.
    job = await served.api.submit_spec(pki.tls("client").identity, parse_job_toml(DILOCO_TOML))
    proc = await start(served, pki, tmp_path, "watch", job.job_id, "--output", "json")
    assert proc.stdout is not None and proc.stderr is not None
    first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
    assert first["job"]["state"] == "pending"

    port = served.server.port
    await served.server.stop(0)  # the scheduler is gone ...
    lost = await asyncio.wait_for(proc.stderr.readline(), 30)
    assert b"scheduler unreachable" in lost and b"reconnecting" in lost
    await served.store.transition(job.job_id, JobState.ALLOCATING)
    await served.store.transition(job.job_id, JobState.RUNNING, workers=["w1", "w2"])
    back = NodeServer(  # ... and back on its address, with the same store
        pki.tls("scheduler"),
        f"127.0.0.1:{port}",
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, served.api, "hypha.v1.Scheduler")],
    )
    await back.start()
    try:
        resumed = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        assert resumed["job"]["state"] == "running"  # the job as it is now
        await served.store.transition(job.job_id, JobState.SUCCEEDED, reason="done")
        raw, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        await back.stop(0)
    assert proc.returncode == 0
    assert [json.loads(line)["job"]["state"] for line in raw.decode().splitlines()] == ["succeeded"]


async def test_logs_fetch_and_workers(served: Served, pki: Pki, tmp_path: Path) -> None:
    job = await served.api.submit_spec(pki.tls("client").identity, parse_job_toml(DILOCO_TOML))
    await served.store.append_logs(job.job_id, [LogEntry("hello"), LogEntry("oops", stream="stderr")])
    for state in (JobState.ALLOCATING, JobState.RUNNING, JobState.SUCCEEDED):
        await served.store.transition(job.job_id, state)
    result = served.orchestrator.result_dir
    result.mkdir()
    (result / "config.json").write_text('{"model_type": "gpt2"}')
    (result / "model.safetensors").write_bytes(os.urandom(1_500_000))

    code, out, err = await hypha(served, pki, tmp_path, "logs", job.job_id)
    assert code == 0 and out == "hello\n" and err == "oops\n"
    code, out, _ = await hypha(served, pki, tmp_path, "logs", job.job_id, "--follow", "--output", "json")
    assert code == 0 and [json.loads(line)["line"] for line in out.splitlines()] == ["hello", "oops"]

    target = tmp_path / "out"
    code, out, _ = await hypha(
        served, pki, tmp_path, "fetch", job.job_id, "--out", str(target), "--output", "json"
    )
    assert code == 0
    files = {f["path"]: f["bytes"] for f in json.loads(out)["files"]}
    assert files == {"config.json": 22, "model.safetensors": 1_500_000}
    for name in files:
        assert (target / name).read_bytes() == (result / name).read_bytes()
    assert not list(target.glob("*.part"))

    code, out, _ = await hypha(served, pki, tmp_path, "workers", "--output", "json")
    assert code == 0 and json.loads(out)[0]["peer"]["peer_id"] == "worker-1"
    code, out, _ = await hypha(served, pki, tmp_path, "workers")
    assert code == 0 and "worker-1" in out and "12.5" in out


def test_submit_resolves_relative_local_paths_against_the_job_files_directory() -> None:
    """What ``hypha submit`` sends: relative paths made absolute, everything else as written."""
    base = Path("/x")
    toml = (
        '[job]\nname = "walk"\ndataset = "d"\nrounds = 2\nquorum = 0.75\n'
        '[job.model]\nlocal_path = "models/tiny"   # beside job.toml\ntype = "causal-lm"\n'
        '[job.preprocessor]\nlocal_path = "../pre"\n'
        "[job.resources]\nnum_workers = 2\nworker = { cpu = 1, memory_gb = 2 }\n"
    )
    resolved = parse_job_toml(resolve_local_paths(toml, base))
    assert resolved.diloco.model.local_path == "/x/models/tiny"
    assert resolved.diloco.preprocessor.local_path == "/pre"
    # The rest of the job is the same job.
    resolved.diloco.model.local_path = resolved.diloco.preprocessor.local_path = "/abs"
    expected = parse_job_toml(toml.replace('"models/tiny"', '"/abs"').replace('"../pre"', '"/abs"'))
    assert resolved == expected
    # The scheduler-config form and an inference job's model are resolved too.
    scheduler_form = '[scheduler.job]\ndataset = "d"\n[scheduler.job.model]\nlocal_path = "m"\n'
    assert parse_job_toml(resolve_local_paths(scheduler_form, base)).diloco.model.local_path == "/x/m"
    inference = INFERENCE.replace('"/models/arithmetic"', '"./arith"')
    assert parse_job_toml(resolve_local_paths(inference, base)).inference.model.local_path == "/x/arith"


@pytest.mark.parametrize(
    "text",
    [
        '[job]\ndataset = "d"\n[job.model]\nlocal_path = "/models/tiny"  # absolute\n',
        '[job]\ndataset = "d"\n[job.model]\nlocal_path = "~/models/tiny"\n',
        '[job]\ndataset = "d"\n[job.model]\nrepository = "openai-community/gpt2"\n',
        '[job]\ncommand = "python3"\nfiles = ["train.py"]\n',
        '[job]\ndataset = "d"\n[job.model\nlocal_path = "models/tiny"\n',  # not TOML: parse names it
    ],
)
def test_submit_sends_a_job_file_without_relative_local_paths_as_written(text: str) -> None:
    assert resolve_local_paths(text, Path("/x")) == text


async def test_submit_makes_a_relative_model_local_path_absolute_against_the_job_file(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    job_dir = tmp_path / "x"
    job_dir.mkdir()
    job_file = job_dir / "job.toml"
    ids = []
    for local_path in ("models/tiny", "/models/tiny"):
        job_file.write_text(f'[job]\ndataset = "d"\n[job.model]\nlocal_path = "{local_path}"\n')
        code, out, err = await hypha(served, pki, tmp_path, "--output", "json", "submit", str(job_file))
        assert code == 0, err
        ids.append(json.loads(out)["job_id"])
    sent = [(await served.store.get(job_id)).spec.diloco.model.local_path for job_id in ids]
    assert sent == [str(job_dir / "models" / "tiny"), "/models/tiny"]


def test_tiny_model_writes_the_demos_model_without_a_scheduler_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from hypha.models import save_arithmetic_model

    for key in [k for k in os.environ if k.startswith("HYPHA_")]:
        monkeypatch.delenv(key)  # no scheduler, no certificates: it only writes files
    monkeypatch.chdir(tmp_path)
    assert cli.main(["tiny-model", "models/tiny"]) == 0
    assert (
        capsys.readouterr().out == f"wrote a 0.63M-parameter causal-lm model to {tmp_path / 'models/tiny'}\n"
    )
    written = load_file(tmp_path / "models/tiny/model.safetensors")
    demo = load_file(save_arithmetic_model(tmp_path / "demo", seed=0) / "model.safetensors")
    assert written.keys() == demo.keys() and all(written[k].equal(demo[k]) for k in demo)

    assert cli.main(["tiny-model", "models/tiny", "--seed", "1"]) == 2
    assert (
        capsys.readouterr().err
        == f"hypha: error: {tmp_path / 'models/tiny'}: not empty (give --force to write into it)\n"
    )
    assert all(t.equal(demo[k]) for k, t in load_file(tmp_path / "models/tiny/model.safetensors").items())

    assert cli.main(["tiny-model", "models/tiny", "--seed", "1", "--force", "--output", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    parameters = sum(t.numel() for t in demo.values())
    assert report == {
        "path": str(tmp_path / "models/tiny"),
        "type": "causal-lm",
        "seed": 1,
        "parameters": parameters,
    }
    reseeded = load_file(tmp_path / "models/tiny/model.safetensors")
    assert not all(reseeded[k].equal(demo[k]) for k in demo)


async def test_an_unreachable_scheduler_is_one_clear_line(pki: Pki, tmp_path: Path) -> None:
    args = ["--scheduler", "127.0.0.1:1", "--certs", str(pki.dir), "--name", "client", "--timeout", "5"]
    code, _, err = await hypha(None, pki, tmp_path, *args, "status")
    assert code == 1 and err.startswith("hypha: error: cannot reach the scheduler") and err.count("\n") == 1


def test_other_modules_can_register_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    def add(parser: object) -> None:
        parser.add_argument("--who", default="world")  # type: ignore[attr-defined]

    def handler(args: object) -> int:
        print(f"hello {args.who}")  # type: ignore[attr-defined]
        return 3

    cli.register("hello", cli.Command("say hello", add, handler))
    try:
        assert cli.main(["hello", "--who", "hypha"]) == 3
    finally:
        del cli.COMMANDS["hello"]
    assert capsys.readouterr().out == "hello hypha\n"
    assert {"up", "down", "demo", "tiny-model"} <= set(cli.COMMANDS)


async def test_a_local_cluster_from_hypha_up_is_found_without_flags(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    state = tmp_path / "no-cluster"  # the state dir _env points the CLI at
    state.mkdir()
    nodes = {"scheduler": {"address": served.address, "role": "scheduler"}}
    (state / "cluster.json").write_text(json.dumps({"pki": str(pki.dir), "nodes": nodes}))
    code, out, err = await hypha(None, pki, tmp_path, "status")
    assert code == 0, err
    assert out.strip() == "no jobs"


async def test_scale_asks_the_scheduler_and_checks_the_count_first(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    job_file = tmp_path / "job.toml"
    job_file.write_text(DILOCO_TOML)
    code, out, _ = await hypha(served, pki, tmp_path, "--output", "json", "submit", str(job_file))
    job_id = json.loads(out)["job_id"]
    await served.store.transition(job_id, JobState.ALLOCATING)  # only an active job scales

    code, out, _ = await hypha(served, pki, tmp_path, "scale", job_id, "--workers", "3")

    assert code == 0 and out == f"scaling {job_id} to 3 trainers\n"
    assert served.orchestrator.scaled == [(job_id, 3)]
    code, _, err = await hypha(served, pki, tmp_path, "scale", job_id, "--workers", "0")
    assert code == 2 and "at least 1" in err
    code, _, err = await hypha(served, pki, tmp_path, "scale", "nope", "--workers", "2")
    assert code == 1 and err.startswith("hypha: error: NOT_FOUND")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process that is no part of any cluster (its pid may be one a dead supervisor had)."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _cluster_file(state: Path, pid: int, started: int | None) -> Path:
    """A ``cluster.json`` naming ``pid`` as supervisor and node (start times as ``hypha up`` records)."""
    state.mkdir(parents=True, exist_ok=True)
    node: dict[str, object] = {"pid": pid, "role": "gateway", "address": "127.0.0.1:1"}
    record: dict[str, object] = {"supervisor": pid, "nodes": {"gw0": node}}
    if started is not None:
        record["supervisor_started"] = node["started"] = started
    path = state / "cluster.json"
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("file", ["start times of other processes", "no start times, written before"])
async def test_down_with_a_stale_cluster_file_signals_no_process_it_did_not_start(
    file: str, sleeper: subprocess.Popen[bytes], pki: Pki, tmp_path: Path
) -> None:
    # Prepare: the supervisor was killed and its pid reused by an unrelated process
    state = tmp_path / "state"
    started = process_start(sleeper.pid)
    assert started is not None
    if file.startswith("start times"):
        path = _cluster_file(state, sleeper.pid, started - 1)
    else:  # a file from before start times were recorded, last written an hour ago
        path = _cluster_file(state, sleeper.pid, None)
        an_hour_ago = time.time() - 3600
        os.utime(path, (an_hour_ago, an_hour_ago))

    # Execute
    code, out, err = await hypha(None, pki, tmp_path, "down", "--state-dir", str(state))

    # Assert: nothing signalled, the file named stale and removed, exit 1 (nothing was running)
    assert sleeper.poll() is None
    assert code == 1 and out == ""
    assert err.startswith(f"hypha down: {path} is stale:") and "signalled nothing" in err
    assert not path.exists()


async def test_down_stops_the_supervisor_the_cluster_file_recorded(
    sleeper: subprocess.Popen[bytes], pki: Pki, tmp_path: Path
) -> None:
    path = _cluster_file(tmp_path / "state", sleeper.pid, process_start(sleeper.pid))

    code, out, err = await hypha(None, pki, tmp_path, "down", "--state-dir", str(path.parent))

    assert (code, out) == (0, "cluster stopped\n"), err
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    assert not path.exists()
