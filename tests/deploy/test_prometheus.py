"""deploy/prometheus/prometheus.yml really scrapes a scheduler, with exactly the TLS settings it names.

The file's paths are Prometheus's; the test issues Prometheus's certificate
with the README's command, maps each path by file name onto what that
command wrote, and fetches a real scheduler's ``/metrics`` with
``ca_file``/``cert_file``/``key_file``/``server_name`` as the file gives them.
Without the client certificate, or verifying another name, it is refused.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import Pki, make_pki
from tests.deploy.readme import DEPLOY, ROOT, bash_block
from tests.helpers import NodeProcess, cli

CONFIG = DEPLOY / "prometheus" / "prometheus.yml"


def _job() -> dict[str, Any]:
    config = yaml.safe_load(CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "hypha-scheduler"]
    return dict(job)


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[Pki, str]]:
    """A real scheduler process with its REST listener (and /metrics) on, and its PKI."""
    pki = make_pki(tmp_path / "ca")  # laid out as the README keeps the CA: ca/acme-ca-*.pem
    config = tmp_path / "scheduler.toml"
    init = [
        *cli("hypha-scheduler"),
        "init",
        "--name",
        "scheduler",
        "--certs",
        str(pki.dir),
        "--out",
        str(config),
    ]
    subprocess.run([*init, "--listen", "127.0.0.1:0"], check=True, capture_output=True, timeout=60)
    node = NodeProcess(
        [*cli("hypha-scheduler"), "run", "--config", str(config)],
        tmp_path,
        "scheduler",
        {"HYPHA_SCHEDULER__REST_LISTEN": "127.0.0.1:0"},
    )
    try:
        rest = str(node.wait_ready()["rest"])
        yield pki, rest
    finally:
        assert node.stop() == 0, node.log()


def test_the_scrape_config_names_the_schedulers_rest_port_over_https() -> None:
    job = _job()
    assert job["scheme"] == "https" and job["metrics_path"] == "/metrics"
    assert set(job["tls_config"]) >= {"ca_file", "cert_file", "key_file", "server_name"}
    (target,) = [t for group in job["static_configs"] for t in group["targets"]]
    # The port the images' scheduler serves REST and /metrics on (docs/containers.md).
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    rest_listen = compose["services"]["scheduler"]["environment"]["HYPHA_SCHEDULER__REST_LISTEN"]
    assert target.rsplit(":", 1)[1] == rest_listen.rsplit(":", 1)[1] == "7201"


def test_gateways_and_workers_are_scraped_on_the_port_compose_serves_their_metrics_on() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    gateway_targets = [t for group in jobs["hypha-gateway"]["static_configs"] for t in group["targets"]]
    for target in gateway_targets:
        host, port = target.rsplit(":", 1)
        assert services[host]["environment"]["HYPHA_GATEWAY__METRICS_LISTEN"].rsplit(":", 1)[1] == port
    (workers,) = jobs["hypha-worker"]["dns_sd_configs"]
    worker_env = services[workers["names"][0]]["environment"]
    assert worker_env["HYPHA_WORKER__METRICS_LISTEN"].rsplit(":", 1)[1] == str(workers["port"])
    for name in ("hypha-gateway", "hypha-worker"):
        assert jobs[name]["scheme"] == "https" and "cert_file" in jobs[name]["tls_config"]


def _issue_prometheus_certificate(workdir: Path) -> Path:
    """README "Prometheus": the command that gives Prometheus its certificate (the CA in workdir/ca)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-euc", bash_block("Prometheus")],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return workdir / "prometheus-certs"


def _context(files: dict[str, Path], with_client_certificate: bool = True) -> ssl.SSLContext:
    """TLS as Prometheus does it from tls_config: verify by ca_file, present cert_file/key_file."""
    ctx = ssl.create_default_context(cafile=files["ca_file"])
    if with_client_certificate:
        ctx.load_cert_chain(files["cert_file"], files["key_file"])
    return ctx


async def _scrape(url: str, ctx: ssl.SSLContext, server_name: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        async with session.get(url, ssl=ctx, server_hostname=server_name) as response:
            return response.status, await response.text()


@pytest.mark.timeout(120)
async def test_the_scrape_config_scrapes_a_real_scheduler_and_nothing_less_gets_in(
    scheduler: tuple[Pki, str], tmp_path: Path
) -> None:
    pki, rest = scheduler
    job = _job()
    tls = job["tls_config"]
    certs = _issue_prometheus_certificate(pki.dir.parent)
    files = {key: certs / Path(tls[key]).name for key in ("ca_file", "cert_file", "key_file")}
    assert all(path.is_file() for path in files.values()), files
    url = f"{rest}{job['metrics_path']}"

    status, text = await _scrape(url, _context(files), tls["server_name"])
    assert status == 200
    assert "# TYPE hypha_scheduler_" in text and "hypha_scheduler_tasks_queued 0" in text

    # No client certificate: refused in the handshake.
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        await _scrape(url, _context(files, with_client_certificate=False), tls["server_name"])
    # server_name is checked: a name the scheduler's certificate does not carry fails verification.
    with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
        await _scrape(url, _context(files), "gateway")
