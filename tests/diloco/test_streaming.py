"""Streaming DiLoCo's pure parts: fragments, the staggered schedule, per-fragment outer steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.diloco import checkpoint
from hypha.diloco.outer import NesterovOuter
from hypha.diloco.server_core import ParameterServerCore
from hypha.diloco.streaming import (
    FragmentedOuter,
    StreamingSchedule,
    fragment_of_round,
    fragments_for,
    merge_fragment,
    partition,
    rebase_fragment,
)
from hypha.errors import InvalidArgumentError


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=30), data=st.data())
def test_partition_covers_every_name_once_in_order_and_no_fragment_is_empty(
    sizes: list[int], data: st.DataObject
) -> None:
    # Prepare
    fragments = data.draw(st.integers(1, len(sizes)))
    named = {f"p{i}": size for i, size in enumerate(sizes)}

    # Execute
    groups = partition(named, fragments)

    # Assert
    assert len(groups) == fragments and all(groups)
    assert [name for group in groups for name in group] == list(named)


def test_partition_balances_equal_layers() -> None:
    groups = partition({f"layer{i}": 100 for i in range(8)}, 4)
    assert [len(g) for g in groups] == [2, 2, 2, 2]


@pytest.mark.parametrize(("h", "f"), [(8, 4), (10, 3), (5, 5), (7, 1)])
def test_each_fragment_syncs_every_h_steps_once_offset_by_f_h_over_f(h: int, f: int) -> None:
    # Prepare
    schedule = StreamingSchedule(h, f)
    steps = range(1, 5 * h + 1)

    # Execute
    syncs = {frag: [s for s in steps if frag in schedule.syncing(s)] for frag in range(f)}

    # Assert: period H, first sync at offset + H, and (with F > 1) never two fragments at once.
    for frag, at in syncs.items():
        offset = frag * h // f
        assert at == list(range(offset + h, 5 * h + 1, h))
    if len({frag * h // f for frag in range(f)}) == f:
        assert all(len(schedule.syncing(s)) <= 1 for s in steps)


def test_overlap_lands_each_fragment_steps_after_its_sync() -> None:
    schedule = StreamingSchedule(8, 4, overlap_steps=2)
    assert schedule.syncing(10) == [1]
    assert schedule.landing(12) == [1] and schedule.landing(10) == [0]
    with pytest.raises(InvalidArgumentError, match="overlap_steps"):
        StreamingSchedule(8, 4, overlap_steps=8)
    with pytest.raises(InvalidArgumentError, match="fragments"):
        StreamingSchedule(4, 5)


def test_fragmented_outer_steps_only_its_fragment_like_a_nesterov_outer_on_it() -> None:
    # Prepare
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(3, 4, generator=gen) for n in ("a", "b", "c")}
    fragmented = FragmentedOuter(params, [["a"], ["b", "c"]], lr=0.7, momentum=0.9)
    reference = NesterovOuter({n: params[n] for n in ("b", "c")}, lr=0.7, momentum=0.9)
    deltas = [({n: torch.randn(3, 4, generator=gen) for n in ("b", "c")}, samples) for samples in (8, 24)]
    avg = {n: deltas[0][0][n] * 0.25 + deltas[1][0][n] * 0.75 for n in ("b", "c")}

    # Execute
    for _ in range(3):
        new = fragmented.step(1, deltas)
        expected = reference.step(avg)

    # Assert
    assert set(new) == {"b", "c"}
    for n in ("b", "c"):
        torch.testing.assert_close(new[n], expected[n])
    assert torch.equal(fragmented.parameters()["a"], params["a"])
    with pytest.raises(InvalidArgumentError, match="exactly once"):
        FragmentedOuter(params, [["a"], ["a", "b"]], lr=0.7, momentum=0.9)


def test_merge_fragment_mixes_local_progress_with_the_new_global() -> None:
    local = {"w": torch.full((2,), 4.0)}
    merge_fragment(local, {"w": torch.zeros(2)}, 0.25)
    assert torch.equal(local["w"], torch.full((2,), 1.0))
    merge_fragment(local, {"w": torch.full((2,), 7.0)}, 0.0)
    assert torch.equal(local["w"], torch.full((2,), 7.0))


def _fragment_job(
    seed: int,
) -> tuple[dict[str, torch.Tensor], list[list[str]], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    theta0 = {f"layer{i}.weight": torch.randn(4, 3 + i, generator=gen) for i in range(5)}
    fragments = fragments_for(theta0, 3)
    assert fragments is not None
    deltas = [{n: torch.randn(t.shape, generator=gen) * 0.1 for n, t in theta0.items()} for _ in range(14)]
    return theta0, fragments, deltas


def test_a_core_with_fragments_steps_round_r_mod_f_exactly_like_fragmented_outer() -> None:
    # Prepare: 7 rounds of 2 workers over 3 fragments, checkpointed and restored half way.
    theta0, fragments, deltas = _fragment_job(0)
    core = ParameterServerCore(NesterovOuter(theta0, 0.7, 0.9), ["a", "b"], 30.0, 1.0, fragments=fragments)
    reference = FragmentedOuter(theta0, fragments, 0.7, 0.9)

    # Execute
    for r in range(7):
        names = fragments[fragment_of_round(r, 3)]
        pair = [({n: deltas[2 * r + w][n] for n in names}, 10 + w) for w in range(2)]
        for worker, (delta, samples) in zip("ab", pair, strict=True):
            assert core.add_delta(worker, r, samples, delta, now=0.0).accepted
        update = core.maybe_complete(0.0)
        expected = reference.step(fragment_of_round(r, 3), pair)
        if r == 3:
            core = checkpoint.restore(checkpoint.unpack(checkpoint.pack(core)))

        # Assert: the update holds the fragment only; θ_global and the momentum match bit for bit.
        assert update is not None and update.fragment == r % 3 and set(update.params) == set(names)
        assert all(torch.equal(update.params[n], expected[n]) for n in names)
    assert core.fragments == fragments and core.outer.steps == 7
    assert all(torch.equal(core.outer.parameters()[n], t) for n, t in reference.parameters().items())


def test_a_delta_for_another_fragment_is_refused() -> None:
    theta0, fragments, deltas = _fragment_job(1)
    core = ParameterServerCore(NesterovOuter(theta0, 0.7, 0.9), ["a"], 30.0, 1.0, fragments=fragments)
    with pytest.raises(InvalidArgumentError, match="missing from the delta"):
        core.add_delta("a", 0, 5, {n: deltas[0][n] for n in fragments[1]}, now=0.0)
    with pytest.raises(InvalidArgumentError, match="cover every parameter"):
        ParameterServerCore(NesterovOuter(theta0, 0.7, 0.9), ["a"], 30.0, 1.0, fragments=fragments[:2])


def test_rebase_keeps_the_progress_made_in_flight_and_is_exact_without_any() -> None:
    # Prepare
    sent = {"w": torch.tensor([1.0, 2.0])}
    moved = {"w": torch.tensor([1.5, 2.0])}
    still = {"w": sent["w"].clone()}
    new_global = {"w": torch.tensor([0.3, 0.1])}

    # Execute
    rebase_fragment(moved, sent, new_global)
    rebase_fragment(still, sent, new_global)

    # Assert
    assert torch.allclose(moved["w"], torch.tensor([0.8, 0.1]))
    assert torch.equal(still["w"], new_global["w"])
