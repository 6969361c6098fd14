"""End-to-end tests: a whole local cluster as real processes (``hypha.testing.cluster``)."""

from hypha.testing.cluster import (
    DATASET,
    FAST_MARKET,
    SAMPLES_PER_SLICE,
    TERMINAL,
    E2ECluster,
    children_of,
    merge_overrides,
)

__all__ = [
    "DATASET",
    "FAST_MARKET",
    "SAMPLES_PER_SLICE",
    "TERMINAL",
    "E2ECluster",
    "children_of",
    "merge_overrides",
]
