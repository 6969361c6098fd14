"""The README's by-hand walkthrough, command by command, as real processes.

The README uses fixed example ports (7000, 7001, 7100, 7200); here every node
binds port 0 and the addresses it reports in its ready file take their place,
so the sequence runs anywhere. Everything else is the README's commands and
flags: certificates, two federated gateways with the DHT, a data node with a
prepared dataset, a scheduler, three workers, `hypha submit --watch`, `hypha
fetch`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import NodeProcess, cli

pytestmark = pytest.mark.timeout(240)


def sh(cwd: Path, *argv: str) -> str:
    res = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{argv}: {res.stderr[-2000:]}"
    return res.stdout


def test_the_readme_walkthrough_trains_and_fetches_a_model(tmp_path: Path) -> None:
    from hypha.worker.executors.models import save_tiny_model

    cert = cli("hypha-certutil")
    ca = ["--ca-cert", "pki/acme-ca-cert.pem", "--ca-key", "pki/acme-ca-key.pem"]
    sh(tmp_path, *cert, "root", "--out", "pki")
    sh(
        tmp_path,
        *cert,
        "org",
        "--ca-cert",
        "pki/root-ca-cert.pem",
        "--ca-key",
        "pki/root-ca-key.pem",
        "--name",
        "acme",
        "--out",
        "pki",
    )
    for name, role in [
        ("gw0", "gateway"),
        ("gw1", "gateway"),
        ("data0", "data"),
        ("sched0", "scheduler"),
        ("w0", "worker"),
        ("w1", "worker"),
        ("w2", "worker"),
        ("client", "client"),
    ]:
        sh(tmp_path, *cert, "node", *ca, "--role", role, "--name", name, "--out", "pki")

    nodes: list[NodeProcess] = []

    def run(prog: str, name: str, *sets: str) -> dict[str, str]:
        argv = [*cli(prog), "run", "--config", f"{name}.toml"]
        for item in sets:
            argv += ["--set", item]
        node = NodeProcess(argv, tmp_path, name, cwd=tmp_path)
        nodes.append(node)
        return node.wait_ready(60)

    try:
        sh(
            tmp_path,
            *cli("hypha-gateway"),
            "init",
            "--name",
            "gw0",
            "--certs",
            "pki",
            "--out",
            "gw0.toml",
            "--listen",
            "127.0.0.1:0",
        )
        sh(
            tmp_path,
            *cli("hypha-gateway"),
            "init",
            "--name",
            "gw1",
            "--certs",
            "pki",
            "--out",
            "gw1.toml",
            "--listen",
            "127.0.0.1:0",
        )
        gw0 = run("hypha-gateway", "gw0", "gateway.dht_port=0")
        dht = json.dumps([gw0["dht"]])
        gw1 = run(
            "hypha-gateway",
            "gw1",
            f"gateway.peers={json.dumps([gw0['address']])}",
            f"gateway.dht_bootstrap={dht}",
        )
        gateways = ["--gateway", gw0["address"], "--gateway", gw1["address"]]
        assert "SERVING" in sh(
            tmp_path, *cli("hypha-gateway"), "probe", gw0["address"], "--certs", "pki", "--name", "client"
        )

        sh(
            tmp_path,
            *cli("hypha-data"),
            "prepare",
            "--data-dir",
            "data",
            "--name",
            "arithmetic",
            "--synthetic",
            "arithmetic",
            "--samples",
            "1024",
            "--samples-per-slice",
            "32",
        )
        sh(
            tmp_path,
            *cli("hypha-data"),
            "init",
            "--name",
            "data0",
            "--certs",
            "pki",
            "--out",
            "data0.toml",
            *gateways,
        )
        run("hypha-data", "data0", 'data.data_dir="data"', f"data.dht_bootstrap={dht}")

        sh(
            tmp_path,
            *cli("hypha-scheduler"),
            "init",
            "--name",
            "sched0",
            "--certs",
            "pki",
            "--out",
            "sched0.toml",
            "--listen",
            "127.0.0.1:0",
            *gateways,
        )
        sched = run("hypha-scheduler", "sched0", f"scheduler.dht_bootstrap={dht}")
        models = tmp_path / "models"
        save_tiny_model("causal-lm", models / "tiny", seed=0)
        for name in ("w0", "w1", "w2"):
            sh(
                tmp_path,
                *cli("hypha-worker"),
                "init",
                "--name",
                name,
                "--certs",
                "pki",
                "--out",
                f"{name}.toml",
                *gateways,
            )
            run("hypha-worker", name, f"worker.jobs.local_model_roots={json.dumps([str(models)])}")

        (tmp_path / "job.toml").write_text(
            '[job]\nname = "walkthrough"\ndataset = "arithmetic"\nrounds = 1\nsamples_per_round = 64\n'
            "min_batch_size = 8\nmax_batch_size = 8\n"
            f'[job.model]\nlocal_path = {json.dumps(str(models / "tiny"))}\ntype = "causal-lm"\n'
            "[job.resources]\nnum_workers = 2\n"
        )
        client = [*cli("hypha"), "--scheduler", sched["address"], "--certs", "pki", "--name", "client"]
        out = sh(tmp_path, *client, "submit", "job.toml", "--watch", "--output", "json")
        job_id = json.loads(out.strip().splitlines()[0])["job_id"]
        final = json.loads(out.strip().splitlines()[-1])
        assert final["job"]["state"] == "succeeded", out[-2000:]
        sh(tmp_path, *client, "fetch", job_id, "--out", "model/")
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    finally:
        for node in reversed(nodes):
            node.stop()
