"""The README's by-hand walkthrough, run from the README's own command blocks.

The blocks marked ``readme-test: certificates``, ``by-hand-mesh``,
``by-hand-job-file`` and ``by-hand-jobs`` are read from README.md each run, so
editing the README edits this test. It starts in an empty directory and uses the
README's relative paths (``ca/``, ``pki/``, ``models/tiny``, ``job.toml``), so
every step a newcomer needs is one the README gives. What the test changes, and
nothing more:

- the README's example ports (7000, 7001, 7100, 7200) become free ports found
  here, so the walkthrough runs beside anything else on the machine;
- each ``run`` becomes a real background process whose ready file we wait for
  (the README starts them with ``&`` or in another terminal);
- ``submit`` gets ``--output json`` so the job id can be read, and ``JOB_ID``
  becomes that id;
- from the certificates block only the CA commands run (its other lines are
  examples naming files that do not exist yet);
- the ``by-hand-job-file`` block is written, verbatim, to ``job.toml`` (the
  README says "save this as job.toml").
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from tests.deploy.readme import marked_block
from tests.helpers import NodeProcess, cli

pytestmark = pytest.mark.timeout(300)

PROGRAMS = ("hypha-certutil", "hypha-gateway", "hypha-scheduler", "hypha-worker", "hypha-data", "hypha")


def commands(block: str) -> list[str]:
    """The block's commands, one per entry: continuations joined, comments dropped, ``for`` loops unrolled."""
    text = block.replace("\\\n", " ")
    lines = [line.split(" # ")[0].split("  #")[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    out: list[str] = []
    i = 0
    while i < len(lines):
        loop = re.match(r"for (\w+) in ([^;]+); do\s*(.*)$", lines[i])
        if loop is None:
            out.append(lines[i])
            i += 1
            continue
        var, values, rest = loop.group(1), loop.group(2).split(), loop.group(3)
        body: list[str] = []
        if rest.endswith("; done"):  # for n in a b; do CMD; done
            body = [rest.removesuffix("; done").strip()]
            i += 1
        else:  # multi-line: do \n CMD \n CMD & \n done
            i += 1
            while lines[i] != "done":
                body.append(lines[i])
                i += 1
            i += 1
        out += [cmd.replace(f"${var}", value) for value in values for cmd in body]
    return out


def free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Walkthrough:
    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.nodes: list[NodeProcess] = []
        self.ports = {
            "7000": free_port(socket.SOCK_STREAM),
            "7001": free_port(socket.SOCK_STREAM),
            "7100": free_port(socket.SOCK_DGRAM),
            "7200": free_port(socket.SOCK_STREAM),
        }
        self.job_id = ""

    def argv(self, command: str) -> list[str]:
        for example, port in self.ports.items():
            command = re.sub(rf"(?<=[:=]){example}\b", str(port), command)
        command = command.replace("JOB_ID", self.job_id)
        argv = shlex.split(command.rstrip("&").strip())
        assert argv[0] in PROGRAMS, f"the walkthrough runs only hypha programs: {command!r}"
        return [*cli(argv[0]), *argv[1:]]

    def do(self, command: str) -> str:
        argv = self.argv(command)
        if "run" in argv and "--config" in argv:  # a node: in the background, ready when it says so
            name = Path(argv[argv.index("--config") + 1]).stem
            node = NodeProcess(argv, self.cwd, name, cwd=self.cwd)
            self.nodes.append(node)
            node.wait_ready(60)
            return ""
        if "submit" in argv:
            argv += ["--output", "json"]
        res = subprocess.run(argv, cwd=self.cwd, capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, f"{command}: {res.stderr[-2000:]}"
        if "submit" in argv:
            self.job_id = json.loads(res.stdout.strip().splitlines()[0])["job_id"]
            final = json.loads(res.stdout.strip().splitlines()[-1])
            assert final["job"]["state"] == "succeeded", res.stdout[-2000:]
        return res.stdout

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()


def test_the_readme_walkthrough_trains_and_fetches_a_model(tmp_path: Path) -> None:
    ca_commands = [
        c for c in commands(marked_block("certificates")) if re.match(r"hypha-certutil (root|org)\b", c)
    ]
    assert len(ca_commands) == 2, ca_commands
    mesh = commands(marked_block("by-hand-mesh"))
    jobs = commands(marked_block("by-hand-jobs"))
    assert any(c.startswith("hypha tiny-model ") for c in jobs), "the README makes no model"
    (tmp_path / "job.toml").write_text(marked_block("by-hand-job-file"))
    walk = Walkthrough(tmp_path)
    try:
        for command in [*ca_commands, *mesh, *jobs]:
            walk.do(command)
    finally:
        walk.stop()

    # Nodes hold their own files only: the CA keys stayed in ca/.
    assert sorted(p.name for p in (tmp_path / "ca").glob("*-key.pem")) == [
        "acme-ca-key.pem",
        "root-ca-key.pem",
    ]
    assert not list((tmp_path / "pki").glob("*ca-key.pem"))
    # Two outer rounds happened and the fetched model loads and predicts.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    import torch

    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()
