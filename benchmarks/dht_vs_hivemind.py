"""Provider lookup beside hivemind 1.1.12's DHT, in one run, on the same machine (issue 18).

Run from the repository root::

    python benchmarks/dht_vs_hivemind.py [--quick] [--rounds N] [--uvloop] [--hivemind-python PATH]

hivemind is never a dependency of this project: ``--hivemind-python`` (default
``$HIVEMIND_PYTHON``, else ``/tmp/hm/bin/python``) names an interpreter that
can ``import hivemind``; without one the run is skipped with a message and a
JSON line saying why. A throwaway environment that works::

    python -m venv /tmp/hm && /tmp/hm/bin/pip install --no-deps hivemind==1.1.12 \\
        scipy prefetch_generator msgpack configargparse py-multihash varint base58 netaddr py-cid
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/hm/lib/python3.11/site-packages/zz.pth

Per system and round: 20 DHT nodes, each its own OS process (ours: one
``benchmarks/dht.py --serve-node`` process each; hivemind: one ``hivemind.DHT``
process each, with its p2pd), joined through the first (star bootstrap on
127.0.0.1). Four datasets with three signed provider records each; hivemind
stores the same bytes as values under the dataset key, one subkey per
provider. One live reader (the 20th node) runs sequential lookups: healthy,
then with two nodes SIGKILLed, then with two more SIGSTOPped (hung; fewer
lookups, as hivemind may wait its 3 s RPC timeout on them). Rounds alternate
which system goes first. Rows: our default ``find_providers`` (cache),
ours with the cache off (every lookup walks, answers early), ours waiting for
the whole walk (``min_providers=None``); hivemind's default ``get`` (first
value; node-local cache), ``get`` with ``cache_locally`` off (every get
walks), and ``get(latest=True)`` (exhaustive). Figures per row are medians
over rounds of each round's p50 / p99, the max over all, and the share of
lookups that found all three providers. Ours verifies every record it
returns; hivemind checks nothing (the bytes are only compared here).

The last stdout line is one JSON object (ARCHITECTURE §11): figure = our
default p99 / hivemind default p99 with 2 dead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NODES = 20
KILLED = 2
HUNG = 2
PHASES = ("healthy", "killed", "hung")
OURS_MODES = ("default", "no_cache", "whole_walk")
HIVEMIND_MODES = ("get", "get_no_cache", "get_latest")
HIVEMIND_WAIT_S = 900

#: Raw results of one system in one round: phase -> mode -> [(milliseconds, found all), ...]
Samples = dict[str, dict[str, list[tuple[float, bool]]]]


# -- hivemind side (runs under --hivemind-python; imports nothing from hypha) ------------------------


async def _forget_local(dht: Any, node: Any) -> None:
    """In the reader's DHT process: drop what it stores or cached, so its gets go to the network."""
    node.protocol.storage.clear()
    node.protocol.cache.clear()


async def _cache_on(dht: Any, node: Any) -> None:
    node.cache_locally = True


async def _cache_off(dht: Any, node: Any) -> None:
    node.cache_locally = False
    node.protocol.cache.clear()


def _family(pid: int) -> list[int]:
    """``pid`` and its descendants (a hivemind.DHT process and the p2pd it started)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid] + [p for child in children for p in _family(int(child))]


def _signal_node(dht: Any, sig: int) -> None:
    for pid in _family(dht.pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def hivemind_side(spec: dict[str, Any]) -> Samples:
    """One hivemind round: start 20 nodes, store, look up through three phases, stop everything."""
    import hivemind
    from hivemind.utils import get_dht_time

    listen = ["/ip4/127.0.0.1/tcp/0"]
    records: dict[str, dict[str, bytes]] = {
        dataset: {provider: bytes.fromhex(blob) for provider, blob in providers}
        for dataset, providers in spec["records"].items()
    }
    rng = random.Random(spec["seed"])
    peers: list[Any] = []
    reader = None
    gone: set[int] = set()
    stopped: set[int] = set()
    samples: Samples = {}
    try:
        peers.append(hivemind.DHT(start=True, host_maddrs=listen))
        bootstrap = peers[0].get_visible_maddrs()
        for _ in range(NODES - 2):
            peers.append(hivemind.DHT(start=True, initial_peers=bootstrap, host_maddrs=listen))
        reader = hivemind.DHT(start=True, initial_peers=bootstrap, host_maddrs=listen)
        expiration = get_dht_time() + 3600
        for dataset, providers in records.items():
            for provider, blob in providers.items():
                assert peers[0].store(dataset, blob, expiration, subkey=provider)
        reader.run_coroutine(_forget_local)
        datasets = sorted(records)

        def lookups(count: int, mode: str) -> list[tuple[float, bool]]:
            assert reader is not None
            reader.run_coroutine(_cache_off if mode == "get_no_cache" else _cache_on)
            out = []
            for _ in range(count):
                dataset = rng.choice(datasets)
                started = time.perf_counter()
                found = reader.get(dataset, latest=mode == "get_latest")
                elapsed = (time.perf_counter() - started) * 1000
                value = found.value if found is not None else None
                got = {k: v.value for k, v in value.items()} if isinstance(value, dict) else {}
                out.append((elapsed, got == records[dataset]))
            return out

        for phase in PHASES:
            if phase == "killed":
                for index in spec["victims"][:KILLED]:
                    _signal_node(peers[index], signal.SIGKILL)
                    gone.add(index)
            if phase == "hung":
                for index in spec["victims"][KILLED:]:
                    _signal_node(peers[index], signal.SIGSTOP)
                    stopped.add(index)
            count = spec["hung_lookups"] if phase == "hung" else spec["lookups"]
            samples[phase] = {mode: lookups(count, mode) for mode in HIVEMIND_MODES}
    finally:
        for index, peer in enumerate(peers):
            if index in stopped:
                _signal_node(peer, signal.SIGCONT)
            if index in gone or index in stopped:
                _signal_node(peer, signal.SIGKILL)
            else:
                peer.shutdown()
        if reader is not None:
            reader.shutdown()
    return samples


# -- our side ----------------------------------------------------------------------------------------


async def ours_side(spec: dict[str, Any], pki_dir: Path, blobs: list[bytes], use_uvloop: bool) -> Samples:
    """One round of ours: 19 node processes plus an in-process reader, the same phases as hivemind's."""
    from dht import RPC_TIMEOUT_S, Peers, _verifier

    from hypha.dht import DhtNode

    rng = random.Random(spec["seed"])
    datasets = sorted(spec["records"])
    peers = Peers(pki_dir, processes=True, use_uvloop=use_uvloop)
    reader: DhtNode | None = None
    samples: Samples = {}
    try:
        await peers.start(NODES - 1)
        reader = await DhtNode.create(
            bootstrap=[peers.addresses[0]], verifier=_verifier(pki_dir), rpc_timeout_s=RPC_TIMEOUT_S
        )
        for blob in blobs:
            await reader.announce(blob)
        reader.providers._keys.clear()  # ksize 20 of 20 nodes: the reader stores all; make it ask
        default_fresh_s = reader.cache_fresh_s

        async def lookups(count: int, mode: str) -> list[tuple[float, bool]]:
            assert reader is not None
            reader.cache_fresh_s = 0.0 if mode == "no_cache" else default_fresh_s
            out = []
            for _ in range(count):
                dataset = rng.choice(datasets)
                started = time.perf_counter()
                if mode == "whole_walk":
                    found = await reader.find_providers(dataset, timeout_s=5.0, min_providers=None)
                else:
                    found = await reader.find_providers(dataset, timeout_s=5.0)
                elapsed = (time.perf_counter() - started) * 1000
                out.append((elapsed, {r.provider for r in found} == {p for p, _ in spec["records"][dataset]}))
                await reader.wait_refreshed()  # lookups are spaced in practice; not timed
            return out

        for phase in PHASES:
            if phase == "killed":
                for index in spec["victims"][:KILLED]:
                    await peers.kill(index)
            if phase == "hung":
                for index in spec["victims"][KILLED:]:
                    peers.hang(index)
            count = spec["hung_lookups"] if phase == "hung" else spec["lookups"]
            samples[phase] = {mode: await lookups(count, mode) for mode in OURS_MODES}
    finally:
        if reader is not None:
            await reader.stop()
        await peers.stop()
    return samples


def _records(pki: Any, datasets: list[str]) -> tuple[list[bytes], dict[str, list[tuple[str, str]]]]:
    """Our signed provider records, and per dataset (provider, hex bytes) for hivemind to store."""
    from dht import _announcements, _verifier

    blobs = _announcements(pki, datasets)
    verifier = _verifier(pki.dir)
    by_dataset: dict[str, list[tuple[str, str]]] = {d: [] for d in datasets}
    for blob in blobs:
        record = verifier.verify(blob)
        by_dataset[record.dataset].append((record.provider, blob.hex()))
    return blobs, by_dataset


def _run_hivemind(python: str, spec: dict[str, Any]) -> Samples:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "ERROR")}
    try:
        done = subprocess.run(
            [python, __file__, "--hivemind-side", f.name],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            timeout=HIVEMIND_WAIT_S,
            check=True,
        )
    finally:
        os.unlink(f.name)
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return {p: {m: [(ms, ok) for ms, ok in rows] for m, rows in modes.items()} for p, modes in raw.items()}


def _hivemind_missing(python: str) -> str | None:
    """Why ``python`` cannot run the hivemind side, or None when it can."""
    try:
        done = subprocess.run(
            [python, "-c", "import hivemind; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot run {python}: {err}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import hivemind ({last})"
    return None


def summarise(rounds: list[Samples]) -> dict[str, dict[str, dict[str, float]]]:
    """Per phase and mode: medians over rounds of p50 / p99, the overall max, and found-all share."""
    from _common import median, percentile

    table: dict[str, dict[str, dict[str, float]]] = {}
    for phase in rounds[0]:
        table[phase] = {}
        for mode in rounds[0][phase]:
            per_round = [[ms for ms, _ in r[phase][mode]] for r in rounds]
            oks = [ok for r in rounds for _, ok in r[phase][mode]]
            table[phase][mode] = {
                "p50_ms": round(median([median(ms) for ms in per_round]), 3),
                "p99_ms": round(median([percentile(ms, 99) for ms in per_round]), 3),
                "max_ms": round(max(max(ms) for ms in per_round), 3),
                "found_all": round(sum(oks) / len(oks), 4),
                "lookups": len(oks),
            }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 30 lookups per phase (10 hung)")
    parser.add_argument("--rounds", type=int, help="rounds per system (default 5, --quick 1)")
    parser.add_argument("--uvloop", action="store_true", help="run our event loops on uvloop")
    parser.add_argument(
        "--hivemind-python",
        default=os.environ.get("HIVEMIND_PYTHON", "/tmp/hm/bin/python"),
        help="an interpreter that can import hivemind (default $HIVEMIND_PYTHON or /tmp/hm/bin/python)",
    )
    parser.add_argument("--hivemind-side", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hivemind_side:
        spec = json.loads(Path(args.hivemind_side).read_text())
        print(json.dumps(hivemind_side(spec)), flush=True)
        return

    from _common import report, temp_pki

    missing = _hivemind_missing(args.hivemind_python)
    if missing is not None:
        print(f"skipped: {missing}; see this script's docstring for a throwaway environment", file=sys.stderr)
        print(json.dumps({"name": "dht_vs_hivemind", "skipped": missing}), flush=True)
        return
    rounds = args.rounds or (1 if args.quick else 5)
    pki = temp_pki()
    datasets = [f"dataset-{d}" for d in range(4)]
    blobs, by_dataset = _records(pki, datasets)
    ours: list[Samples] = []
    theirs: list[Samples] = []
    for r in range(rounds):
        victims = random.Random(100 + r).sample(range(1, NODES - 1), KILLED + HUNG)
        spec = {
            "records": by_dataset,
            "victims": victims,
            "seed": r,
            "lookups": 30 if args.quick else 100,
            "hung_lookups": 10 if args.quick else 20,
        }
        order = ["ours", "hivemind"] if r % 2 == 0 else ["hivemind", "ours"]
        for system in order:
            started = time.perf_counter()
            if system == "ours":
                ours.append(_run_ours(spec, pki.dir, blobs, args.uvloop))
            else:
                theirs.append(_run_hivemind(args.hivemind_python, spec))
            print(f"round {r + 1}/{rounds} {system}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    table = {"ours": summarise(ours), "hivemind": summarise(theirs)}
    for system, phases in table.items():
        for phase, modes in phases.items():
            for mode, row in modes.items():
                print(
                    f"{system:8} {phase:7} {mode:12} p50 {row['p50_ms']:8.3f}  p99 {row['p99_ms']:8.3f}  "
                    f"max {row['max_ms']:8.3f} ms  found {row['found_all']:.0%}",
                    file=sys.stderr,
                )
    ours_p99 = table["ours"]["killed"]["default"]["p99_ms"]
    their_p99 = table["hivemind"]["killed"]["get"]["p99_ms"]
    report(
        "dht_vs_hivemind",
        ours_p99,
        "ms",
        their_p99,
        ours_p99 / their_p99,
        description="default find_providers p99 with 2 of 20 nodes dead, beside hivemind 1.1.12 DHT.get p99",
        ratios={
            f"{phase}_{stat}": round(
                table["ours"][phase]["default"][stat] / table["hivemind"][phase]["get"][stat], 4
            )
            for phase in PHASES
            for stat in ("p50_ms", "p99_ms")
        },
        table=table,
        rounds=rounds,
        uvloop=args.uvloop,
        quick=args.quick,
    )


def _run_ours(spec: dict[str, Any], pki_dir: Path, blobs: list[bytes], use_uvloop: bool) -> Samples:
    if use_uvloop:
        import uvloop

        return uvloop.run(ours_side(spec, pki_dir, blobs, True))
    return asyncio.run(ours_side(spec, pki_dir, blobs, False))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
