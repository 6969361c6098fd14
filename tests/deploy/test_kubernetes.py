"""deploy/kubernetes: valid against the Kubernetes schemas, and right where it matters.

Rendered offline (``kubectl kustomize``, or the fallback in ``kustomize.py``)
and validated strictly (unknown fields are errors) against the OpenAPI
schemas of the oldest and newest Kubernetes versions we claim, then checked
for what a schema cannot see: only our images, non-root pods that cannot
escalate, an mTLS health probe on every container, GPUs requested by the
GPU workers only, Services that reach their pods, certificate Secrets
(made by the README's own commands) that hold exactly the files each node
reads and never a CA key, a worker container that mounts no Secret (its init
container copies its own identity out of the pool), and no job sandbox
turned off.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.deploy.kustomize import Resource, kubectl, pod_specs, render, render_fallback, render_kubectl
from tests.deploy.readme import DEPLOY, ROOT, bash_block

KUSTOMIZATIONS = {"base": DEPLOY / "kubernetes" / "base", "cpu": DEPLOY / "kubernetes" / "overlays" / "cpu"}
#: The oldest Kubernetes the manifests are meant for, and the newest schema we have.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
OUR_IMAGES = {"hypha-core", "hypha-worker", "hypha-worker-gpu"}
HEALTHCHECK = ["hypha-node", "healthcheck"]
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Resource]]:
    return request.param, render(KUSTOMIZATIONS[request.param])


def _env(container: Resource) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def _by_kind(resources: list[Resource], kind: str) -> dict[str, Resource]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def test_every_manifest_is_valid_against_the_kubernetes_schemas(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    kinds = sorted({r["kind"] for r in resources})
    assert kinds == ["Namespace", "Service", "StatefulSet"], kinds
    for resource in resources:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{resource['kind']}/{resource['metadata']['name']} on {version}: {err}")


def test_the_fallback_renders_what_kubectl_renders() -> None:
    if kubectl() is None:
        pytest.skip("kubectl is not installed: the fallback renderer is what the other tests use")
    for directory in KUSTOMIZATIONS.values():
        key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
        assert sorted(render_fallback(directory), key=key) == sorted(render_kubectl(directory), key=key)


def test_workloads_run_only_our_images_as_non_root_with_mtls_probes(
    rendered: tuple[str, list[Resource]],
) -> None:
    _, resources = rendered
    pods = pod_specs(resources)
    assert sorted(pods) == ["data", "gw0", "gw1", "scheduler", "worker"]
    for name, pod in pods.items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, name
        assert context["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False, name
        # The worker's one init container copies its identity; no other pod has one.
        assert [c["name"] for c in pod.get("initContainers", [])] == (
            ["identity"] if name == "worker" else []
        )
        for container in pod.get("initContainers", []):
            image, _, tag = container["image"].partition(":")
            assert image in OUR_IMAGES and tag, f"{name}: {container['image']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "runAsUser" not in security or security["runAsUser"] == 10001, name
        for container in pod["containers"]:
            image, _, tag = container["image"].partition(":")
            assert image in OUR_IMAGES and tag, f"{name}: {container['image']}"
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert "runAsUser" not in security or security["runAsUser"] == 10001, name
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["exec"]["command"] == HEALTHCHECK, f"{name}: {probe}"
            assert container["resources"]["requests"]["cpu"], name
            assert container["resources"]["requests"]["memory"], name
            # A read-only root needs a writable /tmp: hypha-node writes the node's config there.
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert "/tmp" in mounts and mounts["/certs"]["readOnly"] is True, name


def test_the_worker_container_mounts_only_its_own_identity_and_no_secret(
    rendered: tuple[str, list[Resource]],
) -> None:
    _, resources = rendered
    pod = pod_specs(resources)["worker"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (worker,) = pod["containers"]
    (init,) = pod["initContainers"]
    mounted = {m["mountPath"]: volumes[m["name"]] for m in worker["volumeMounts"]}
    assert not [v for v in mounted.values() if "secret" in v or "projected" in v], mounted
    # /certs is the in-memory volume the init container fills from the pool Secret.
    certs = mounted["/certs"]
    assert certs["emptyDir"]["medium"] == "Memory", certs
    init_mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    assert volumes[init_mounts["/pool"]["name"]]["secret"]["secretName"] == "hypha-workers"
    assert init_mounts["/pool"]["readOnly"] is True
    assert init_mounts["/identity"]["name"] == certs["name"]
    assert init["args"] == ["copy-identity", "/pool", "/identity"]
    assert init["image"] == worker["image"]  # the cpu overlay's image rewrite reaches it too
    # It copies the replica's own name, the one the worker runs as.
    (name,) = [e for e in init["env"] if e["name"] == "HYPHA_NODE_NAME"]
    assert name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert _env(worker)["HYPHA_NODE_NAME"] == "$(POD_NAME)"


def test_copy_identity_takes_only_the_named_replicas_files(tmp_path: Path) -> None:
    """The init container's command (docker/hypha-node copy-identity) on a Secret like hypha-workers."""
    pool, dest = tmp_path / "pool", tmp_path / "identity"
    pool.mkdir()
    for k in (0, 1):
        for part in ("cert", "key", "trust"):
            (pool / f"worker-{k}-{part}.pem").write_text(f"worker-{k} {part}")
            (pool / f"worker-{k}-{part}.pem").chmod(0o440)
    node = ["sh", str(ROOT / "docker" / "hypha-node"), "copy-identity", str(pool), str(dest)]
    env = {**os.environ, "HYPHA_NODE_NAME": "worker-1"}
    out = subprocess.run(node, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in dest.iterdir()) == [
        f"worker-1-{part}.pem" for part in ("cert", "key", "trust")
    ]
    assert (dest / "worker-1-key.pem").read_text() == "worker-1 key"
    assert (dest / "worker-1-key.pem").stat().st_mode & 0o777 == 0o600
    missing = subprocess.run(
        node, env={**env, "HYPHA_NODE_NAME": "worker-2"}, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "worker-2-cert.pem" in missing.stderr, missing.stderr


def test_no_manifest_turns_the_job_sandbox_off(rendered: tuple[str, list[Resource]]) -> None:
    _, resources = rendered
    for name, pod in pod_specs(resources).items():
        for container in pod.get("initContainers", []) + pod["containers"]:
            sandbox = _env(container).get("HYPHA_WORKER__JOBS__SANDBOX", "auto")
            assert sandbox != "none", f"{name}/{container['name']}"


def test_gpu_workers_request_gpus_and_the_cpu_overlay_none(rendered: tuple[str, list[Resource]]) -> None:
    variant, resources = rendered
    pods = pod_specs(resources)
    (worker,) = pods["worker"]["containers"]
    requests, limits = worker["resources"]["requests"], worker["resources"]["limits"]
    if variant == "base":
        assert worker["image"] == "hypha-worker-gpu:latest"
        assert str(requests[GPU]) == str(limits[GPU]) == "1"
    else:
        assert worker["image"] == "hypha-worker:latest"
        assert GPU not in requests and GPU not in limits
    for name, pod in pods.items():
        if name != "worker":
            assert all(GPU not in c["resources"].get("limits", {}) for c in pod["containers"]), name


def test_services_reach_their_pods_and_nodes_are_dialled_at_their_certificate_names(
    rendered: tuple[str, list[Resource]],
) -> None:
    _, resources = rendered
    services, sets = _by_kind(resources, "Service"), _by_kind(resources, "StatefulSet")
    assert {r["metadata"].get("namespace") for r in resources if r["kind"] != "Namespace"} == {"hypha"}
    for name, workload in sets.items():
        governing = services[workload["spec"]["serviceName"]]
        assert governing["spec"]["clusterIP"] == "None", name  # a StatefulSet's Service is headless
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for name, service in services.items():
        targets = [
            s
            for s in sets.values()
            if service["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {name} selects {len(targets)} workloads"
        ports = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports, name
    # Nodes are dialled by Service name, so each one's certificate name is its Service's name.
    for name in ("gw0", "gw1", "scheduler", "data"):
        (container,) = sets[name]["spec"]["template"]["spec"]["containers"]
        assert _env(container)["HYPHA_NODE_NAME"] == name and sets[name]["spec"]["serviceName"] == name
    (worker,) = sets["worker"]["spec"]["template"]["spec"]["containers"]
    assert _env(worker)["HYPHA_ADVERTISE"] == "$(POD_NAME).worker:7300"
    assert services["scheduler-api"]["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in services["scheduler-api"]["spec"]["ports"]} == {7200, 7201}


def _run_readme_kubernetes_commands(workdir: Path) -> tuple[list[Resource], list[Resource]]:
    """README "Kubernetes": issue the certificates, create the Secrets, apply (kubectl in --dry-run)."""
    pki = workdir / "ca"  # the README keeps the CA's files in ca/
    certutil = [sys.executable, "-m", "hypha.pki.cli"]
    subprocess.run([*certutil, "root", "--out", str(pki)], check=True, capture_output=True, timeout=60)
    root = ["--ca-cert", str(pki / "root-ca-cert.pem"), "--ca-key", str(pki / "root-ca-key.pem")]
    org = [*certutil, "org", *root, "--name", "acme", "--out", str(pki)]
    subprocess.run(org, check=True, capture_output=True, timeout=60)
    (workdir / "deploy").symlink_to(DEPLOY)
    # kubectl without a cluster: objects are printed (--dry-run=client), `apply -k` renders.
    shim = (
        "set -eu\n"
        "kubectl() {\n"
        '  if [ "$1" = apply ]; then command kubectl kustomize "$3" > applied.yaml; return; fi\n'
        '  command kubectl "$@" --dry-run=client -o yaml >> objects.yaml; echo --- >> objects.yaml\n'
        "}\n"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-c", shim + bash_block("Kubernetes")], cwd=workdir, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all((workdir / "objects.yaml").read_text()) if d]
    applied = [d for d in yaml.safe_load_all((workdir / "applied.yaml").read_text()) if d]
    return objects, applied


@pytest.mark.timeout(300)
def test_readme_secrets_hold_each_nodes_certificate_and_no_ca_key(tmp_path: Path) -> None:
    if kubectl() is None:
        pytest.skip("kubectl is not installed: the README's kubectl commands cannot run offline")
    objects, applied = _run_readme_kubernetes_commands(tmp_path)
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    assert {o["metadata"]["namespace"] for o in secrets.values()} == {"hypha"}
    sets = _by_kind(applied, "StatefulSet")
    # Every Secret a pod mounts exists, and every Secret made is mounted.
    mounted = {
        v["secret"]["secretName"]: name
        for name, pod in pod_specs(applied).items()
        for v in pod["volumes"]
        if "secret" in v
    }
    assert sorted(mounted) == sorted(secrets)
    for secret_name, workload in mounted.items():
        files = {k: base64.b64decode(v) for k, v in secrets[secret_name]["data"].items()}
        if workload == "worker":
            names = [f"worker-{k}" for k in range(sets["worker"]["spec"]["replicas"])]
        else:
            (container,) = sets[workload]["spec"]["template"]["spec"]["containers"]
            names = [_env(container)["HYPHA_NODE_NAME"]]
        assert sorted(files) == sorted(f"{n}-{part}.pem" for n in names for part in ("cert", "key", "trust"))
        for name in names:
            _check_node_files(name, files)
    # The names nodes are dialled at are in their certificates.
    scheduler = x509.load_pem_x509_certificate(
        base64.b64decode(secrets["hypha-scheduler"]["data"]["scheduler-cert.pem"])
    )
    assert {"scheduler", "scheduler-api", "scheduler-api.hypha.svc"} <= _dns_names(scheduler)
    worker = x509.load_pem_x509_certificate(
        base64.b64decode(secrets["hypha-workers"]["data"]["worker-1-cert.pem"])
    )
    assert "worker-1.worker" in _dns_names(worker)


def _check_node_files(name: str, files: dict[str, bytes]) -> None:
    """The key is the node's own (matches its certificate), and that certificate is no CA."""
    cert = x509.load_pem_x509_certificate(files[f"{name}-cert.pem"])
    key = serialization.load_pem_private_key(files[f"{name}-key.pem"], password=None)
    assert key.public_key() == cert.public_key(), name
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca is False, name
    # The one private key in the Secret is that node key: none rides along in the PEM bundles.
    assert files[f"{name}-key.pem"].count(b"-----BEGIN PRIVATE KEY-----") == 1, name
    for part in ("cert", "trust"):
        assert b"PRIVATE KEY" not in files[f"{name}-{part}.pem"], name


def _dns_names(cert: x509.Certificate) -> set[Any]:
    return set(
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    )
