"""Path arguments of every CLI, made absolute as they are parsed.

A path given on the command line means the caller's working directory; the
processes it reaches (nodes, executors) run elsewhere, so it is anchored once,
here, before anything uses it.
"""

from __future__ import annotations

from pathlib import Path


def absolute_path(text: str) -> Path:
    """``argparse`` ``type=``: ``~`` expanded, relative to the working directory, not resolved
    (symlinks in it are kept, as the user wrote them)."""
    return Path(text).expanduser().absolute()
