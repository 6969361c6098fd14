"""Hypha: distributed ML training on heterogeneous, poorly connected machines.

Shared code lives here (libs/hypha); each node role lives in services/<role>
and is importable as ``hypha.<role>``.
"""

__version__ = "0.1.0"
