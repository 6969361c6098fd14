"""The launcher every executor starts through: limits in every mode, Landlock that fails closed.

Each test runs the real launcher (``python -P -m hypha.worker.confine``) the
way ``Sandbox.wrap`` builds its command line, with a small Python program as
the job that reports what it could do.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Literal

import pytest

from hypha.worker.confine import EXIT_CONFINE
from hypha.worker.sandbox import Sandbox, landlock_abi, launcher

pytestmark = pytest.mark.timeout(60)

needs_landlock = pytest.mark.skipif(not landlock_abi(), reason="needs a kernel with Landlock")
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="needs bubblewrap (scripts/system-deps.sh)"
)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=30, env=env)


def _job(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code), *args]


_LIMITS = """
    import errno, os, resource
    print(open("/proc/self/oom_score_adj").read().strip())
    print(resource.getrlimit(resource.RLIMIT_CORE)[1], resource.getrlimit(resource.RLIMIT_FSIZE)[1])
    fd = os.open("big", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"x" * 6000)
    try:
        os.write(fd, b"x")
        print("wrote past the limit")
    except OSError as err:
        print(errno.errorcode[err.errno])
"""


@pytest.mark.parametrize(
    "mode", ["none", pytest.param("landlock", marks=needs_landlock), pytest.param("bwrap", marks=needs_bwrap)]
)
def test_every_job_is_the_oom_killers_first_choice_dumps_no_core_and_writes_no_file_past_its_lease(
    mode: Literal["none", "landlock", "bwrap"], tmp_path: Path
) -> None:
    sandbox = Sandbox(mode, shutil.which("bwrap") if mode == "bwrap" else None)
    argv = sandbox.wrap(_job(_LIMITS), tmp_path, network=True, max_file_bytes=6000)

    done = _run(argv, tmp_path)

    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["1000", "0 6000", "EFBIG"]
    assert (tmp_path / "big").stat().st_size == 6000


_ESCAPES = """
    import os, sys
    def attempt(name, action):
        try:
            action()
            print(name, "ok")
        except OSError as err:
            print(name, "denied", err.errno)
    attempt("key", lambda: open(sys.argv[1]).read())
    attempt("outside", lambda: open(sys.argv[2], "w").write("x"))
    attempt("own", lambda: open("own.txt", "w").write("x"))
    attempt("signal", lambda: os.kill(int(sys.argv[3]), 0))
    attempt("environ", lambda: open(f"/proc/{sys.argv[3]}/environ", "rb").read())
"""


@needs_landlock
def test_a_landlocked_job_reaches_only_its_work_dir_and_not_its_parent(tmp_path: Path) -> None:
    # Prepare: a key beside the work dir; the test process (root in CI: a job that kept its
    # capabilities could read any /proc file) stands in for the worker
    key = tmp_path / "node-key.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----")
    work = tmp_path / "work"
    work.mkdir()
    job = _job(_ESCAPES, str(key), str(tmp_path / "outside.txt"), str(os.getpid()))
    argv = Sandbox("landlock").wrap(job, work, network=True)

    # Execute
    done = _run(argv, work)

    # Assert: EACCES for files outside, EPERM for the signal; its own dir works
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:5] == [
        "key denied 13",
        "outside denied 13",
        "own ok",
        "signal denied 1",
        "environ denied 13",
    ]
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.parametrize(
    ("mode", "refusal"),
    [
        pytest.param("landlock", "PermissionError", marks=needs_landlock),  # TCP handled, no rule
        pytest.param("bwrap", "ConnectionRefusedError", marks=needs_bwrap),  # a network namespace of its own
    ],
)
@pytest.mark.parametrize("network", [True, False])
def test_a_bridge_only_executor_opens_no_tcp_connection(
    mode: Literal["landlock", "bwrap"], refusal: str, network: bool, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=10); print('connected')"
        )
        sandbox = Sandbox(mode, shutil.which("bwrap") if mode == "bwrap" else None)
        argv = sandbox.wrap(_job(code), tmp_path, network=network)

        done = _run(argv, tmp_path)

    if network:  # a task job: the network is its own business
        assert done.returncode == 0 and done.stdout.strip() == "connected", done.stderr
    else:
        assert done.returncode != 0 and refusal in done.stderr, done.stderr


def test_an_unconfined_job_cannot_read_the_proc_files_of_a_worker_run_as_the_same_user(
    tmp_path: Path,
) -> None:
    # Prepare: a stand-in worker as it runs in a container, a user without capabilities (what the
    # test drops, when it runs as root), hardened as ``hypha-worker run`` hardens itself
    parent = textwrap.dedent(
        """
        import os, subprocess, sys
        from hypha.worker.cli import CLI
        from hypha.worker.confine import drop_capabilities
        drop_capabilities()
        CLI.prepare_run()
        argv = [str(os.getpid()) if arg == "PARENT" else arg for arg in sys.argv[1:]]
        sys.exit(subprocess.run(argv).returncode)
        """
    )
    job = _job(_ESCAPES, os.devnull, os.devnull, "PARENT")
    argv = Sandbox("none").wrap(job, tmp_path, network=True)
    argv[argv.index("--parent") + 1] = "PARENT"

    # Execute
    done = _run([sys.executable, "-c", parent, *argv], tmp_path)

    # Assert: it may signal the worker (same user, no sandbox), but not read its environment
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[3:5] == ["signal ok", "environ denied 13"]


def _marker_job(tmp_path: Path) -> list[str]:
    return _job(f"open({str(tmp_path / 'ran')!r}, 'w').close()")


def test_a_launcher_whose_parent_is_gone_runs_nothing(tmp_path: Path) -> None:
    # --parent names another process than the one that started it: as if the worker died meanwhile
    argv = [*launcher(), "--parent", str(os.getpid() + 1_000_000), "--", *_marker_job(tmp_path)]

    done = _run(argv, tmp_path)

    assert done.returncode == EXIT_CONFINE and "parent process" in done.stderr
    assert not (tmp_path / "ran").exists()


@needs_landlock
def test_landlock_that_cannot_be_enforced_runs_nothing(tmp_path: Path) -> None:
    # Prepare: a landlockpy that reports a kernel without Landlock (ABI 0)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "landlockpy.py").write_text("def abi_version():\n    return 0\n")
    argv = Sandbox("landlock").wrap(_marker_job(tmp_path), tmp_path, network=True)

    # Execute
    done = _run(argv, tmp_path, env={**os.environ, "PYTHONPATH": str(fake)})

    # Assert
    assert done.returncode == EXIT_CONFINE
    assert "hypha-confine: not started: Landlock is unavailable" in done.stderr
    assert not (tmp_path / "ran").exists()


@needs_landlock
def test_a_ruleset_the_kernel_refuses_runs_nothing(tmp_path: Path) -> None:
    # Landlock stacks at most 16 rulesets: the 17th launcher's restrict_self fails (E2BIG).
    argv = _marker_job(tmp_path)
    for _ in range(17):
        argv = Sandbox("landlock").wrap(argv, tmp_path, network=True)

    done = _run(argv, tmp_path)

    assert done.returncode == EXIT_CONFINE and "Landlock ruleset not enforced" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_our_executors_make_themselves_non_dumpable() -> None:
    code = (
        "import ctypes; from hypha.worker.executors.process import configure_process;"
        "configure_process(); print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"  # PR_GET_DUMPABLE
    )

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
