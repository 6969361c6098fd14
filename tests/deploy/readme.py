"""The README's command blocks, so tests run the very commands users copy."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def bash_block(heading: str, index: int = 0) -> str:
    """The ``index``-th fenced bash block of README.md's section ``## heading``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) > index, f"README section {heading!r} has {len(blocks)} bash blocks"
    return blocks[index]


def marked_block(marker: str) -> str:
    """The fenced block right after README.md's ``<!-- readme-test: marker -->`` comment."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- readme-test: {re.escape(marker)} -->\n```\w*\n(.*?)```", text, flags=re.DOTALL)
    assert found is not None, f"README has no block marked {marker!r}"
    return found.group(1)
