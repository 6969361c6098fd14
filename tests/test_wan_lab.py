"""The link lab of ``benchmarks/wan.py`` (``hypha.testing.wan``): a capped link really caps, in
both directions, and nothing of a lab outlives it, whether its body raised, a child inside was
killed, or the process that built it died.

Needs root and iproute2. Without them the tests skip with the reason; with ``CI=true`` that
is a failure instead (CI runs as root, and a benchmark whose lab never runs proves nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hypha.errors import FailedPreconditionError, InvalidArgumentError
from hypha.testing import wan

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "wan.py"
RATE = "20mbit"
#: Enough that the first bucketful (32 KiB) is noise; 2 s a direction at 20 Mbit/s.
TRANSFER_BYTES = 5_000_000

# The receiver prints its port, then the payload bytes and the seconds from first byte to EOF.
RECEIVER = """
import json, socket, time
server = socket.create_server(("0.0.0.0", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
got, first = 0, None
while chunk := conn.recv(1 << 16):
    first = first or time.perf_counter()
    got += len(chunk)
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - first}), flush=True)
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20) as sock:
    sock.sendall(bytes(int(sys.argv[3])))
"""


@pytest.fixture
def lab_tools() -> None:
    reason = wan.unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and the link lab cannot run: {reason}")
    pytest.skip(reason)


def _listed() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _transfer(lab: wan.WanLab, sender: str, receiver: str, address: str) -> float:
    """Payload bits per second of one TCP transfer from namespace ``sender`` to ``address``."""
    recv = lab.popen(receiver, sys.executable, "-c", RECEIVER, stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        port = recv.stdout.readline().strip()
        lab.run(sender, sys.executable, "-c", SENDER, address, port, str(TRANSFER_BYTES), timeout=20)
        out, _ = recv.communicate(timeout=20)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(5)
    result = json.loads(out)
    assert result["bytes"] == TRANSFER_BYTES
    return float(result["bytes"]) * 8 / float(result["seconds"])


@pytest.mark.timeout(40)
def test_a_capped_link_carries_tcp_at_its_rate_in_both_directions(lab_tools: None) -> None:
    cap = wan.parse_rate(RATE)
    assert cap is not None
    with wan.wan_lab(1, RATE) as lab:
        site = lab.sites[0]
        up = _transfer(lab, site.namespace, lab.hub, lab.hub_address)
        down = _transfer(lab, lab.hub, site.namespace, site.address)
        counted = lab.counters(site)
    for name, rate in (("site to hub", up), ("hub to site", down)):
        # Above the cap: the link does not cap. Far below it: something else is the bottleneck.
        assert 0.5 * cap <= rate <= 1.1 * cap, f"{name}: {rate / 1e6:.2f} Mbit/s through a {RATE} link"
    # The counters saw each payload (plus headers) go the way it went.
    assert TRANSFER_BYTES <= counted.sent < 1.2 * TRANSFER_BYTES
    assert TRANSFER_BYTES <= counted.received < 1.2 * TRANSFER_BYTES


@pytest.mark.timeout(30)
def test_sites_reach_each_other_through_the_hub(lab_tools: None) -> None:
    with wan.wan_lab(2, "unlimited") as lab:
        a, b = lab.sites
        before = lab.all_counters()
        _transfer(lab, a.namespace, b.namespace, b.address)
        sent_a, sent_b = (after - start for after, start in zip(lab.all_counters(), before, strict=True))
    # Forwarded by the hub: it left a's link and came in on b's.
    assert sent_a.sent >= TRANSFER_BYTES and sent_b.received >= TRANSFER_BYTES


@pytest.mark.timeout(30)
def test_the_namespaces_are_gone_after_the_body_raised_and_nothing_inside_survives(lab_tools: None) -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="the body failed"), wan.wan_lab(2, RATE) as lab:
        names = lab.namespaces
        killed = lab.popen(lab.sites[0].namespace, "sleep", "600")
        left = lab.popen(lab.sites[1].namespace, "sleep", "600")
        killed.kill()
        killed.wait(5)
        assert set(names) <= _listed()
        raise RuntimeError("the body failed")
    assert names and not set(names) & _listed()
    # The child left running inside was ended, not orphaned holding the namespace's links.
    assert left.wait(10) == -signal.SIGTERM


@pytest.mark.timeout(60)
def test_a_lab_whose_owner_died_is_swept_and_a_live_one_is_not(lab_tools: None) -> None:
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from hypha.testing.wan import wan_lab\n"
            "with wan_lab(1, '20mbit') as lab:\n"
            "    print(' '.join(lab.namespaces), flush=True)\n"
            "    time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    orphaned = owner.stdout.readline().split()
    owner.send_signal(signal.SIGKILL)  # no teardown: the lab is left behind
    owner.wait(10)
    assert orphaned and set(orphaned) <= _listed()
    with wan.wan_lab(1) as live:
        # Building a lab swept the dead one's; sweeping again leaves this one alone.
        assert not set(orphaned) & _listed()
        assert wan.sweep_leftovers() == []
        assert set(live.namespaces) <= _listed()


@pytest.mark.timeout(420)
def test_the_benchmark_quick_run_crosses_the_capped_links_with_every_gradient_and_every_round(
    lab_tools: None, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--quick",
            "--json",
            "--variants",
            "fp32,default",
            "--plot",
            str(tmp_path / "wan.png"),
            "--keep",
        ],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"] == "wan" and list(result["rates"]) == [RATE]
    from transformers import GPT2LMHeadModel

    from hypha.models import ARITHMETIC_GPT2, tiny_gpt2_config

    params = sum(p.numel() for p in GPT2LMHeadModel(tiny_gpt2_config(**ARITHMETIC_GPT2)).parameters())
    model_bytes = 4 * params  # fp32
    capped = result["rates"][RATE]
    # An all-reduce of 2 ranks: each sends and receives one gradient's worth a step.
    assert 2 * model_bytes <= capped["ddp_bytes_per_step"] < 1.3 * 2 * model_bytes
    # Half of that goes each way, and no step is shorter than the link needs for it.
    assert capped["ddp_step_s"] >= 0.9 * (capped["ddp_bytes_per_step"] / 2) * 8 / 20e6

    # Ours: the demo's job ran its rounds with each trainer behind its capped link.
    rounds = result["rounds"]
    # As the trainers reported them: about the planned 50 batches a round (the scheduler splits a
    # round between them by pace and ends it by its plan, a few batches off the planned count).
    for variant, samples in capped["ours_samples_per_trainer"].items():
        assert abs(samples - rounds * 50 * 64) <= 0.1 * rounds * 50 * 64, (variant, samples)
    # Every round each trainer's Δ went up and θ_global came down through its own link.
    assert capped["ours_trainer_bytes"]["fp32"] >= rounds * 2 * model_bytes
    assert capped["ours_bytes"]["fp32"] >= 2 * capped["ours_trainer_bytes"]["fp32"]
    # The parameter server's link takes both trainers' Δ in each round: no round is shorter.
    assert capped["ours_round_s"]["fp32"] >= 0.9 * 2 * model_bytes * 8 / 20e6
    assert 0.0 <= capped["ours_accuracy"]["fp32"] <= 1.0
    # The job file's defaults, int8 both ways (delta_dtype and update_dtype): about a quarter of
    # the model each way a round, through the same links; the data slices and control traffic
    # are the same.
    compressed = capped["ours_trainer_bytes"]["default"]
    assert rounds * 2 * model_bytes / 4 <= compressed <= 0.6 * capped["ours_trainer_bytes"]["fp32"]
    assert result["bytes_ratio_compressed"] > 1.5 * result["bytes_ratio"]
    # ... and overlapped: each round's update lands while the trainers go on training.
    assert capped["ours_update_lag_batches"]["default"] is not None
    assert capped["ours_update_lag_batches"].get("fp32") is None  # a synchronous job waits instead
    for variant in ("fp32", "default"):
        assert 0.0 < capped["utilization"][variant] <= 1.0
        (curve,) = capped["ours_curve"][variant]  # one run
        assert sorted(map(int, curve)) == list(range(rounds + 1))
    # Not measured in a quick run, so not guessed either.
    assert result["ddp_time_to_target_method"].startswith("not measured")
    assert capped["ddp_time_to_target_s"] is None and result["ddp_over_ours_20mbit"] is None
    assert result["utilization_20mbit"] == capped["utilization"]["default"]

    # --keep: each run's node logs and every round metric stay for a closer look; in each round
    # the parameter server took both trainers' Δ (none dropped as late, none missing).
    kept = Path(done.stderr.split("its runs are kept in ")[1].split()[0])
    for variant in ("fp32", "default"):
        run = kept / "runs" / RATE / variant / "0"
        assert (run / "state" / "logs" / "scheduler.log").stat().st_size > 0
        metrics = json.loads((run / "result.json").read_text())["metrics"]
        served = {r: v for r, _, name, v, _ in metrics if name == "contributors"}
        missing = [v for _, _, name, v, _ in metrics if name == "missing"]
        assert served == dict.fromkeys(range(rounds), 2.0) and not any(missing), (variant, served)
    assert (tmp_path / "wan.png").read_bytes().startswith(b"\x89PNG")
    assert not {name for name in _listed() if name.startswith(wan.PREFIX)}


def test_a_lab_cluster_runs_its_core_in_the_hub_and_each_worker_behind_its_own_link(tmp_path: Path) -> None:
    import ipaddress

    from cryptography import x509

    from hypha.testing.wan_cluster import lab_cluster

    lab = wan.WanLab("hyw-0-test-", 3)  # never built: names and addresses are all this needs
    cluster = lab_cluster(lab, tmp_path / "state", {"worker": ["worker.jobs.threads_per_job=1"]})
    hub = ["ip", "netns", "exec", lab.hub]
    assert {name: cluster.launchers[name] for name in ("gw0", "gw1", "data0", "scheduler")} == {
        "gw0": hub,
        "gw1": hub,
        "data0": hub,
        "scheduler": hub,
    }
    for site in lab.sites:
        name = f"worker{site.index}"
        assert cluster.launchers[name] == ["ip", "netns", "exec", site.namespace]
        assert cluster.overrides[name] == [f'net.listen="{site.address}:0"']
        cert = x509.load_pem_x509_certificate((cluster.pki_dir / f"{name}-cert.pem").read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        # Peers check the address they dial against the certificate.
        assert set(names.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address(site.address),
            ipaddress.ip_address("127.0.0.1"),
        }
    # The hub's DHT endpoints are dialled from the sites too.
    assert 'scheduler.dht_host="10.251.0.1"' in cluster.overrides["scheduler"]
    assert 'gateway.dht_host="10.251.0.1"' in cluster.overrides["gw1"]
    assert cluster.overrides["worker"] == ["worker.jobs.threads_per_job=1"]


def test_rates_parse_in_tc_syntax() -> None:
    assert wan.parse_rate("unlimited") is None
    assert wan.parse_rate("1gbit") == 1_000_000_000
    assert wan.parse_rate("100mbit") == 100_000_000
    assert wan.parse_rate("20mbit") == 20_000_000
    assert wan.parse_rate("1.5mbit") == 1_500_000
    assert wan.parse_rate("1mibit") == 1 << 20
    assert wan.parse_rate("10kbps") == 80_000
    with pytest.raises(InvalidArgumentError, match="'20 furlongs'"):
        wan.parse_rate("20 furlongs")
    # tbf drops what exceeds its bucket: never below a GSO burst, whatever the rate.
    assert wan.tbf_burst(20_000_000) == 32 * 1024
    assert wan.tbf_burst(1_000_000_000) == 500_000


def test_a_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert wan.unavailable() == "the link lab needs iproute2: ip and tc not found on PATH"
    with pytest.raises(FailedPreconditionError, match="ip and tc not found"), wan.wan_lab(1):
        pass
