"""Samples per round fitted to the link (``hypha.scheduler.diloco.link_fit``), pure."""

from __future__ import annotations

import json

import pytest

from hypha.errors import InvalidArgumentError
from hypha.scheduler.diloco.link_fit import LinkFit, link_fit_for, resumed
from hypha.scheduler.diloco.round_planner import round_planners
from hypha.v1 import common_pb2


def _round(fit: LinkFit, number: int, idle_s: float, samples: float = 512, rate: float = 100.0) -> int | None:
    """Two trainers' metrics of one round (each half the samples, ``idle_s`` waiting)."""
    first = fit.observe(number, idle_s, samples / 2, rate)
    second = fit.observe(number, idle_s * 0.5, samples / 2, rate)
    assert second is None  # a round is weighed once the next one starts
    return first


def test_a_slow_link_grows_the_rounds_until_the_wait_is_a_small_share_and_a_fast_one_shrinks_them() -> None:
    fit = LinkFit(floor=1024, ceiling=8192, alpha=1.0)
    # 1024 samples: each trainer computes 512 / 100 = 5.12 s and waits 1.28 s (25 %).
    assert _round(fit, 0, 1.28, samples=1024) is None  # round 0 not weighed yet
    grown = _round(fit, 1, 1.28, samples=1024)
    assert grown == 5120  # 25 % ÷ 5 % = 5x the samples: the same wait is 5 % of 25.6 s
    # The link gets faster: a 0.2 s wait on rounds of 5120 samples asks for fewer samples.
    _round(fit, 2, 0.2, samples=5120)
    assert _round(fit, 3, 0.2, samples=5120) == 1024  # 0.2 / 25.6 ÷ 5 % = 0.78x → the floor


def test_the_fit_stays_within_its_range_and_ignores_small_changes() -> None:
    fit = LinkFit(floor=256, ceiling=1024, alpha=1.0)
    _round(fit, 0, 100.0)
    assert _round(fit, 1, 100.0) == 1024  # a link far too slow: the ceiling, not more
    _round(fit, 2, 100.0)
    assert _round(fit, 3, 100.0) is None  # unchanged
    steady = LinkFit(floor=256, ceiling=4096, alpha=1.0, samples=1000)
    _round(steady, 0, 0.26, samples=1000)
    assert _round(steady, 1, 0.26, samples=1000) is None  # asks for 1040: within the hysteresis


def test_the_slowest_trainer_sets_the_round_and_late_or_empty_reports_change_nothing() -> None:
    fit = LinkFit(floor=100, ceiling=10_000, alpha=1.0)
    fit.observe(0, 0.1, 50, 100.0)
    fit.observe(0, 1.0, 50, 100.0)  # this trainer waited 1 s on 0.5 s of compute
    assert fit.observe(1, 0.0, 0, 100.0) is None  # no samples: not a round's figures
    assert fit.observe(1, 0.0, 50, 100.0) == 4000  # 100 * (1.0 / 0.5) / 5 %
    assert fit.observe(0, 50.0, 50, 100.0) is None  # a late report of a weighed round


def test_the_fit_is_on_only_when_the_job_allows_more_samples_and_a_bad_range_is_refused() -> None:
    spec = common_pb2.DilocoJobSpec(samples_per_round=512)
    assert link_fit_for(spec) is None
    spec.max_samples_per_round = 512
    assert link_fit_for(spec) is None
    spec.max_samples_per_round = 4096
    fit = link_fit_for(spec)
    assert fit is not None and (fit.floor, fit.ceiling, fit.samples) == (512, 4096, 512)
    with pytest.raises(InvalidArgumentError):
        LinkFit(floor=512, ceiling=256)


def test_a_restarted_scheduler_goes_on_from_the_saved_fit_within_the_jobs_range() -> None:
    # Prepare: a fit that grew the rounds, and the same job's fit never interrupted.
    spec = common_pb2.DilocoJobSpec(samples_per_round=1024, max_samples_per_round=8192, rounds=10)
    fit, uninterrupted = link_fit_for(spec), link_fit_for(spec)
    assert fit is not None and uninterrupted is not None
    fit.alpha = uninterrupted.alpha = 0.5
    for f in (fit, uninterrupted):
        _round(f, 0, 1.28, samples=1024)
        assert _round(f, 1, 1.28, samples=1024) == 5120
    planner = round_planners()(spec)

    # Execute: the saved state (as JSON, the way the store keeps it) into a new scheduler's run.
    saved = json.loads(json.dumps({"version": 2, "link_fit": fit.saved()}))
    restored = resumed(spec, saved, planner)

    # Assert: the planner goes on at the fitted size, and the next rounds fit as they would have:
    # a faster link asks for 2560, smoothed with the saved 5120 (a fit started afresh: 2560).
    assert restored is not None and planner.samples_per_round == 5120
    for f in (restored, uninterrupted):
        _round(f, 2, 0.64, samples=5120)
    assert _round(restored, 3, 0.64, samples=5120) == _round(uninterrupted, 3, 0.64, samples=5120) == 3840
    # A state saved before the fit existed, or under a narrower range, still resumes sanely.
    assert resumed(spec, {"version": 2}, planner) is not None and planner.samples_per_round == 5120
    narrower = common_pb2.DilocoJobSpec(samples_per_round=1024, max_samples_per_round=2048, rounds=10)
    assert resumed(narrower, saved, planner) is not None and planner.samples_per_round == 2048
    assert resumed(common_pb2.DilocoJobSpec(samples_per_round=1024), saved, planner) is None
