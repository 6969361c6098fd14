"""Parameter-server checkpoints: atomic, verified, and a restart continues bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hypha.diloco import checkpoint
from hypha.diloco.outer import NesterovOuter
from hypha.diloco.server_core import ParameterServerCore, RoundUpdate
from hypha.errors import DataLossError, NotFoundError
from hypha.tensors.payload import read_metadata

SHAPES = {"w": (6, 3), "b": (3,)}
WORKERS = {"w1": 40, "w2": 25, "w3": 90}


def _tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def _core(quorum: float | int = 1.0, give_up_after_s: float | None = None) -> ParameterServerCore:
    outer = NesterovOuter(_tensors(0), lr=0.7, momentum=0.9)
    return ParameterServerCore(outer, WORKERS, 10.0, quorum, give_up_after_s=give_up_after_s)


def _run_round(core: ParameterServerCore, now: float) -> RoundUpdate:
    rnd = core.round_number
    for i, (worker, samples) in enumerate(WORKERS.items()):
        core.add_delta(worker, rnd, samples, _tensors(100 * rnd + i, 0.01), now)
    update = core.maybe_complete(now)
    assert update is not None
    return update


def _assert_same_state(a: ParameterServerCore, b: ParameterServerCore) -> None:
    assert a.round_number == b.round_number
    assert a.expected == b.expected
    assert a.outer.steps == b.outer.steps
    for name in SHAPES:
        assert torch.equal(a.outer.parameters()[name], b.outer.parameters()[name])
    buf_a, buf_b = a.outer.momentum_buffer(), b.outer.momentum_buffer()
    assert (buf_a is None) == (buf_b is None)
    if buf_a is not None and buf_b is not None:
        for name in SHAPES:
            assert torch.equal(buf_a[name], buf_b[name])


def test_restart_from_checkpoint_mid_job_continues_identically(tmp_path: Path) -> None:
    # Prepare: two rounds, checkpointed after each (as the server does).
    original = _core()
    for rnd in range(2):
        _run_round(original, now=float(rnd))
        checkpoint.save(tmp_path, original)

    # Execute: a "restarted" server loads the checkpoint; both run two more rounds.
    restarted = checkpoint.load(tmp_path)
    _assert_same_state(original, restarted)
    for rnd in range(2, 4):
        a = _run_round(original, now=float(rnd))
        b = _run_round(restarted, now=float(rnd))

        # Assert: bit-for-bit identical updates and state.
        assert a.round_number == b.round_number
        for name in SHAPES:
            assert torch.equal(a.params[name], b.params[name])
        _assert_same_state(original, restarted)


def test_checkpoint_before_the_first_round_has_no_momentum(tmp_path: Path) -> None:
    core = _core()
    checkpoint.save(tmp_path, core)
    restored = checkpoint.load(tmp_path)
    assert restored.outer.momentum_buffer() is None
    assert restored.round_number == 0
    _assert_same_state(core, restored)


def test_settings_and_replacements_survive_a_restart(tmp_path: Path) -> None:
    # Prepare
    core = _core(quorum=2, give_up_after_s=30.0)
    core.replace_worker("w3", "w7")

    # Execute
    checkpoint.save(tmp_path, core)
    ckpt = checkpoint.read(tmp_path)

    # Assert
    assert ckpt.expected == frozenset({"w1", "w2", "w7"})
    assert ckpt.quorum == 2 and isinstance(ckpt.quorum, int)
    assert ckpt.give_up_after_s == 30.0
    assert ckpt.round_timeout_s == 10.0
    assert ckpt.outer["lr"] == 0.7 and ckpt.outer["momentum"] == 0.9
    fraction = _core(quorum=0.75)
    checkpoint.save(tmp_path / "f", fraction)
    assert isinstance(checkpoint.read(tmp_path / "f").quorum, float)


def test_failed_manifest_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a good checkpoint after round 0, then a crash while committing round 1's.
    core = _core()
    _run_round(core, now=0.0)
    checkpoint.save(tmp_path, core)
    snapshot = checkpoint.load(tmp_path)
    _run_round(core, now=1.0)
    real_write = checkpoint.write_atomic

    def crash_on_manifest(path: Path, data: bytes) -> None:
        if path.name == checkpoint.MANIFEST_NAME:
            raise OSError("disk gone")
        real_write(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", crash_on_manifest)

    # Execute
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(tmp_path, core)

    # Assert: the old checkpoint still loads, intact.
    _assert_same_state(checkpoint.load(tmp_path), snapshot)
    assert not list(tmp_path.glob(".*.tmp"))


def test_save_keeps_one_tensor_file(tmp_path: Path) -> None:
    core = _core()
    for rnd in range(3):
        _run_round(core, now=float(rnd))
        checkpoint.save(tmp_path, core)
        checkpoint.save(tmp_path, core)  # the same round twice must not clobber the live file
    assert len(list(tmp_path.glob("state-*.safetensors"))) == 1
    _assert_same_state(checkpoint.load(tmp_path), core)


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    assert not checkpoint.exists(tmp_path)
    with pytest.raises(NotFoundError):
        checkpoint.load(tmp_path)


def test_corrupted_tensor_file_is_data_loss(tmp_path: Path) -> None:
    core = _core()
    checkpoint.save(tmp_path, core)
    (tensor_file,) = tmp_path.glob("state-*.safetensors")
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match="sha256"):
        checkpoint.load(tmp_path)


def test_damaged_manifest_is_data_loss(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, _core())
    manifest_path = tmp_path / checkpoint.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())

    manifest_path.write_text("{not json")
    with pytest.raises(DataLossError):
        checkpoint.read(tmp_path)

    del manifest["steps"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataLossError, match="steps"):
        checkpoint.read(tmp_path)

    manifest["steps"] = 0
    manifest["tensors_file"] = "state-missing.safetensors"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataLossError, match="missing"):
        checkpoint.read(tmp_path)


def test_packed_state_restores_bit_for_bit_and_names_its_round() -> None:
    # Prepare: two rounds done, so there is a momentum buffer.
    original = _core()
    for rnd in range(2):
        _run_round(original, now=float(rnd))

    # Execute: one blob leaves the machine; another server restores from it.
    blob = checkpoint.pack(original)
    restored = checkpoint.restore(checkpoint.unpack(blob))

    # Assert: the same state, the same digest; the round readable from the header alone.
    _assert_same_state(original, restored)
    assert checkpoint.state_digest(restored.outer.state_dict()) == checkpoint.state_digest(
        original.outer.state_dict()
    )
    assert read_metadata(blob)[checkpoint.PACKED_ROUND_KEY] == "2"
    a, b = _run_round(original, now=2.0), _run_round(restored, now=2.0)
    for name in SHAPES:
        assert torch.equal(a.params[name], b.params[name])


def test_state_digest_sees_a_single_flipped_bit() -> None:
    core = _core()
    _run_round(core, now=0.0)
    state = core.outer.state_dict()
    before = checkpoint.state_digest(state)
    assert state["momentum_buffer"] is not None
    flat = state["momentum_buffer"]["b"].view(torch.int32)
    flat[0] ^= 1
    assert checkpoint.state_digest(state) != before


@pytest.mark.parametrize("damage", ["truncate", "no-manifest"])
def test_damaged_packed_state_is_data_loss(damage: str) -> None:
    core = _core()
    blob = checkpoint.pack(core)
    if damage == "truncate":
        blob = blob[: len(blob) - 7]
    else:
        from safetensors.torch import save

        blob = save({"params/w": torch.zeros(6, 3)})
    with pytest.raises(DataLossError):
        checkpoint.unpack(blob)


def test_the_checkpoint_file_is_a_pack_and_commits_only_with_its_manifest(tmp_path: Path) -> None:
    # The server writes a round's state once: the local checkpoint's file, which it also
    # publishes for the scheduler, is a ``pack``: ``unpack`` reads the same state from it.
    # (Not byte for byte: safetensors keeps the header's metadata in a hash map, whose
    # order differs from one write to the next.)
    original = _core()
    _run_round(original, now=0.0)
    checkpoint.save(tmp_path, original)
    committed = checkpoint.load(tmp_path)
    _run_round(original, now=1.0)

    written = checkpoint.write_pack(tmp_path, original)

    _assert_same_state(checkpoint.restore(checkpoint.unpack(written.path.read_bytes())), original)
    _assert_same_state(checkpoint.load(tmp_path), committed)  # not the checkpoint yet
    manifest_path = checkpoint.commit(written)
    manifest = json.loads(manifest_path.read_bytes())
    assert manifest["tensors_file"] == written.path.name and manifest["round_number"] == 2
    assert sorted(p.name for p in tmp_path.glob("state-*")) == [written.path.name]
    restored = checkpoint.load(tmp_path)
    _assert_same_state(original, restored)
    a, b = _run_round(original, now=2.0), _run_round(restored, now=2.0)
    for name in SHAPES:
        assert torch.equal(a.params[name], b.params[name])


def test_a_pack_file_left_uncommitted_by_a_crash_is_never_read_and_goes_with_the_next_commit(
    tmp_path: Path,
) -> None:
    core = _core()
    checkpoint.save(tmp_path, core)
    _run_round(core, now=0.0)
    orphan = checkpoint.write_pack(tmp_path, core).path  # the process died before commit
    orphan.write_bytes(orphan.read_bytes()[:100])  # and the file is torn

    _assert_same_state(checkpoint.load(tmp_path), _core())
    checkpoint.save(tmp_path, core)

    assert not orphan.exists()
    _assert_same_state(checkpoint.load(tmp_path), core)
