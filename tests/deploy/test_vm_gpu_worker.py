"""deploy/vm-gpu-worker: an outbound-only GPU worker with only its own certificate, jobs confined.

The README's commands run as written in a scratch copy of the directory
(which plays both the CA's machine and the VM), with ``config`` in place of
``up`` and ``ps``: there is no GPU and no cluster here. The rendered project
must publish no port, advertise no address, reserve the GPUs, mount no CA
key and leave the job sandbox on. The compose PKI's ``issue-worker`` is run too, as the README offers it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.conftest import make_pki
from tests.deploy.readme import DEPLOY, ROOT, bash_block

HERE = DEPLOY / "vm-gpu-worker"


def _compose() -> list[str]:
    """Compose v2 where installed (scripts/compose-plugin.sh), else the python docker-compose."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        try:
            if subprocess.run([*argv, "version"], capture_output=True, timeout=30).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            continue
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


def _config(workdir: Path, env_file: str) -> dict[str, Any]:
    compose = _compose()
    args = ["-f", str(workdir / "docker-compose.yml"), "--env-file", str(workdir / env_file), "config"]
    if compose == ["docker-compose"]:
        out = subprocess.run([*compose, *args], capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        rendered: dict[str, Any] = yaml.safe_load(out.stdout)
        return rendered
    out = subprocess.run([*compose, *args, "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    project: dict[str, Any] = json.loads(out.stdout)
    return project


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume, whichever compose rendered it."""
    found = []
    for volume in service["volumes"]:
        if isinstance(volume, str):  # docker-compose 1.x: SOURCE:TARGET[:ro]
            source, target, *mode = volume.split(":")
            found.append((source, target, mode == ["ro"]))
        else:
            found.append((str(volume["source"]), volume["target"], bool(volume.get("read_only"))))
    return found


def _copy(workdir: Path) -> Path:
    vm = workdir / "vm"
    vm.mkdir()
    for name in ("docker-compose.yml", "worker.env.example"):
        shutil.copy(HERE / name, vm / name)
    return vm


def test_the_example_renders_an_outbound_only_gpu_worker(tmp_path: Path) -> None:
    vm = _copy(tmp_path)
    (worker,) = _config(vm, "worker.env.example")["services"].values()
    assert not worker.get("ports") and not worker.get("expose"), worker.get("ports")
    assert worker.get("network_mode") in (None, "bridge") and "host" not in str(worker.get("network_mode"))
    env = worker["environment"]
    assert env["HYPHA_ADVERTISE"] == "none" and "HYPHA_NET__EXTERNAL_ADDRESSES" not in env
    assert json.loads(env["HYPHA_NET__GATEWAYS"]) == ["gw0.example.org:7000", "gw1.example.org:7000"]
    assert env["HYPHA_NODE_NAME"] == "vm-gpu-1"
    # Jobs stay confined: the sandbox is left at its default (auto: Landlock in a container).
    assert env.get("HYPHA_WORKER__JOBS__SANDBOX", "auto") != "none"
    assert not any("SANDBOX" in line for line in (vm / "worker.env.example").read_text().splitlines())
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] in ("all", -1)  # v2 renders "all" as -1
    assert worker["image"] == "hypha-worker-gpu:latest"
    assert worker["restart"] == "unless-stopped" and worker["init"] is True
    assert worker["healthcheck"]["test"] == ["CMD", "hypha-node", "healthcheck"]
    mounts = {target: (source, ro) for source, target, ro in _mounts(worker)}
    assert sorted(mounts) == ["/certs", "/models", "/var/lib/hypha"]
    assert mounts["/certs"][1] and mounts["/models"][1]


def test_a_required_setting_left_out_fails_with_its_name(tmp_path: Path) -> None:
    vm = _copy(tmp_path)
    lines = (vm / "worker.env.example").read_text().splitlines()
    (vm / "worker.env").write_text(
        "\n".join(line for line in lines if not line.startswith("HYPHA_GATEWAYS="))
    )
    compose = _compose()
    out = subprocess.run(
        [*compose, "-f", str(vm / "docker-compose.yml"), "--env-file", str(vm / "worker.env"), "config"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0 and "HYPHA_GATEWAYS" in out.stderr


@pytest.mark.timeout(180)
def test_readme_steps_mount_the_workers_own_certificate_and_no_ca_key(tmp_path: Path) -> None:
    vm = _copy(tmp_path)
    make_pki(vm / "ca")  # the CA's machine: ca/acme-ca-{cert,key}.pem beside the VM's files here
    compose = " ".join(_compose())
    # No GPU or cluster here: `up` and `ps` become `config`; sudo runs the command when we are root.
    shim = (
        "set -eu\n"
        'sudo() { if [ "$(id -u)" = 0 ]; then "$@"; fi; }\n'
        "docker() {\n"
        '  [ "$1" = compose ] && shift\n'
        "  args=()\n"
        '  for a in "$@"; do\n'
        '    case $a in up|ps) args+=(config --quiet); break ;; *) args+=("$a") ;; esac\n'
        "  done\n"
        f'  command {compose} "${{args[@]}}"\n'
        "}\n"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", shim + bash_block("A GPU worker on a cloud VM")],
        cwd=vm, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (worker,) = _config(vm, "worker.env")["services"].values()
    binds = [Path(source) for source, _, _ in _mounts(worker) if source.startswith("/")]
    assert Path(vm / "certs").resolve() in [b.resolve() for b in binds]
    assert not any((vm / "ca").resolve() in (b.resolve(), *b.resolve().parents) for b in binds)
    certs = vm / "certs"
    assert sorted(p.name for p in certs.iterdir()) == [
        "vm-gpu-1-cert.pem",
        "vm-gpu-1-key.pem",
        "vm-gpu-1-trust.pem",
    ]
    _assert_own_key(certs / "vm-gpu-1-cert.pem", certs / "vm-gpu-1-key.pem")
    for bind in binds:
        for path in bind.rglob("*") if bind.is_dir() else [bind]:
            assert not path.name.endswith("-ca-key.pem"), path


def _assert_own_key(cert_path: Path, key_path: Path) -> None:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == cert.public_key()
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert "OU=worker" in cert.subject.rfc4514_string()


def test_the_compose_pki_issues_a_worker_for_a_vm_as_a_tar(tmp_path: Path) -> None:
    """``hypha-pki issue-worker NAME`` (docker/hypha-pki), on the host, with a CA laid out like pki-ca's."""
    ca = tmp_path / "ca"
    pki = make_pki(ca)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PKI_CA": str(ca),
        "HYPHA_ORG": "acme",
    }
    out = subprocess.run(
        ["sh", str(ROOT / "docker" / "hypha-pki"), "issue-worker", "vm-gpu-1"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        assert sorted(members) == [f"certs/vm-gpu-1-{part}.pem" for part in ("cert", "key", "trust")]
        assert {(m.uid, m.gid) for m in members.values()} == {(10001, 10001)}
        assert members["certs/vm-gpu-1-key.pem"].mode & 0o077 == 0
        tar.extractall(tmp_path / "vm", filter="data")
    _assert_own_key(tmp_path / "vm/certs/vm-gpu-1-cert.pem", tmp_path / "vm/certs/vm-gpu-1-key.pem")
    issued = x509.load_pem_x509_certificate((tmp_path / "vm/certs/vm-gpu-1-cert.pem").read_bytes())
    assert issued.issuer == x509.load_pem_x509_certificate(pki.org_cert.read_bytes()).subject
    refused = subprocess.run(
        ["sh", str(ROOT / "docker" / "hypha-pki"), "issue-worker"], env=env, capture_output=True
    )
    assert refused.returncode == 2 and b"usage" in refused.stderr


def _container_run_unavailable() -> str | None:
    try:
        docker = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        v2 = (
            docker
            and subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode
            == 0
        )
        image = (
            v2
            and subprocess.run(
                ["docker", "image", "inspect", "hypha-worker:latest"], capture_output=True
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return "Docker is not available"
    if not image:
        return "needs Docker, Compose v2 and the hypha-worker:latest image (scripts/images.sh)"
    return None


@pytest.mark.timeout(420)
def test_the_worker_from_this_compose_file_serves_with_its_own_certificate_and_no_port(
    tmp_path: Path,
) -> None:
    """The real image (the CPU worker: no GPU here) under this compose file, its GPU reservation reset."""
    reason = _container_run_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the container check cannot run: {reason}")
        pytest.skip(reason)
    vm = _copy(tmp_path)
    pki = make_pki(vm / "pki")
    pki.issue("worker", "vm-gpu-1")
    certs = vm / "certs"
    certs.mkdir()
    for part in ("cert", "key", "trust"):
        shutil.copy(pki.dir / f"vm-gpu-1-{part}.pem", certs)
        if os.geteuid() == 0:
            os.chown(certs / f"vm-gpu-1-{part}.pem", 10001, 10001)
        else:  # cannot hand it to uid 10001: let it read the key instead
            (certs / f"vm-gpu-1-{part}.pem").chmod(0o644)
    # No cluster: nothing listens at the gateway address, and the worker serves (and retries) anyway.
    settings = (
        (vm / "worker.env.example")
        .read_text()
        .replace(
            'HYPHA_GATEWAYS=["gw0.example.org:7000","gw1.example.org:7000"]', 'HYPHA_GATEWAYS=["127.0.0.1:9"]'
        )
    )
    (vm / "worker.env").write_text(settings + "HYPHA_WORKER_IMAGE=hypha-worker\n")
    (vm / "cpu.yml").write_text("services:\n  worker:\n    deploy: !reset {}\n")
    compose = ["docker", "compose", "-p", f"hyphavm{os.getpid()}", "-f", str(vm / "docker-compose.yml")]
    compose += ["-f", str(vm / "cpu.yml"), "--env-file", str(vm / "worker.env")]
    try:
        up = subprocess.run(
            [*compose, "up", "-d", "--wait", "--wait-timeout", "240"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        logs = subprocess.run(
            [*compose, "logs", "--no-color"], capture_output=True, text=True, timeout=60
        ).stdout
        assert up.returncode == 0, f"{up.stderr}\n{logs}"
        (container,) = subprocess.run([*compose, "ps", "-q"], capture_output=True, text=True).stdout.split()
        info = json.loads(
            subprocess.run(["docker", "inspect", container], capture_output=True, text=True).stdout
        )[0]
        assert info["State"]["Health"]["Status"] == "healthy"
        assert not info["HostConfig"]["PortBindings"] and not any(info["NetworkSettings"]["Ports"].values())
        ready = [
            json.loads(line.split("| ", 1)[1]) for line in logs.splitlines() if '"event": "ready"' in line
        ]
        assert [r["name"] for r in ready] == ["vm-gpu-1"]
    finally:
        subprocess.run([*compose, "down", "--volumes", "--timeout", "20"], capture_output=True, timeout=120)
