"""Render a kustomization offline: ``kubectl kustomize`` where installed, else the subset deploy/ uses.

The fallback knows only what deploy/kubernetes uses (``resources``,
``namespace``, ``images``, inline JSON 6902 ``patches``) and refuses any
other key, so it can never quietly render something kustomize would render
differently; where kubectl is installed a test holds the two to the same output.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

Resource = dict[str, Any]

#: Kinds without a namespace among those deploy/ uses.
CLUSTER_SCOPED = frozenset({"Namespace"})

_KNOWN_KEYS = frozenset({"apiVersion", "kind", "namespace", "resources", "images", "patches"})


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(directory: Path) -> list[Resource]:
    """Every resource the kustomization in ``directory`` produces."""
    if kubectl() is None:
        return render_fallback(directory)
    return render_kubectl(directory)


def render_kubectl(directory: Path) -> list[Resource]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def render_fallback(directory: Path) -> list[Resource]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN_KEYS
    assert not unknown, f"{directory}: the fallback renderer does not know {sorted(unknown)}"
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources.extend(render_fallback(path))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for patch in spec.get("patches", []):
        target = patch["target"]
        assert set(target) == {"kind", "name"}, f"{directory}: the fallback matches kind and name only"
        hits = [
            r for r in resources if r["kind"] == target["kind"] and r["metadata"]["name"] == target["name"]
        ]
        assert hits, f"{directory}: patch target {target} matches nothing"
        operations = yaml.safe_load(patch["patch"])
        resources = [jsonpatch.apply_patch(r, operations) if r in hits else r for r in resources]
    for image in spec.get("images", []):
        for container in _containers(resources):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in spec:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = spec["namespace"]
    return resources


def pod_specs(resources: list[Resource]) -> dict[str, Resource]:
    """Workload name -> its pod template's spec."""
    return {
        r["metadata"]["name"]: r["spec"]["template"]["spec"]
        for r in resources
        if r["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    }


def _containers(resources: list[Resource]) -> list[Resource]:
    return [
        container
        for spec in pod_specs(resources).values()
        for container in spec.get("initContainers", []) + spec["containers"]
    ]
