"""Executors written for the reference system's job bridge API, run against ours (docs/job-bridge.md)."""
