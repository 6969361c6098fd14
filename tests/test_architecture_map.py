"""The layout rules of ARCHITECTURE §10 and docs/architecture.md, checked over the tree.

- every module (``hypha.x.y``, ``hypha.x.y:Name``) and path the map names exists;
- no symlinks in the tree (``git ls-files -s`` mode 120000, or untracked ones);
- a role imports only the core library, never another role; the core imports no role
  (``hypha.testing`` excepted: it is the tests' and benchmarks' harness and drives roles);
- production code never imports ``hypha.testing``, and benchmarks never import ``tests``;
- no hand-written module exceeds 800 lines (generated ``libs/hypha/v1`` excepted).
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "architecture.md"
ROLES = ("gateway", "scheduler", "worker", "data", "client")
CORE = REPO / "libs" / "hypha"
GENERATED = CORE / "v1"
MAX_LINES = 800

_DOTTED = re.compile(r"^hypha(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?$")
_PATH = re.compile(r"^(?:libs|services|tests|benchmarks|docs|proto|scripts|deploy)/[\w./-]*$")


def git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.splitlines()


def python_files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts and ".egg-info" not in str(path):
                yield path


def module_file(dotted: str) -> Path | None:
    """The file of ``hypha.a.b`` in the core or in role ``a``'s distribution (a package: its dir)."""
    parts = dotted.split(".")[1:]
    bases = [CORE]
    if parts[0] in ROLES:
        bases.append(REPO / "services" / parts[0] / "hypha")
    for base in bases:
        stem = base.joinpath(*parts)
        if stem.with_suffix(".py").is_file():
            return stem.with_suffix(".py")
        if stem.is_dir() and any(stem.glob("*.py")):
            return stem
    return None


def defines(path: Path, name: str) -> bool:
    """Whether module ``path`` binds ``name`` at its top level (a class, function or assignment)."""
    if path.is_dir():
        path = path / "__init__.py"
        if not path.is_file():
            return False
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, ast.Assign | ast.AnnAssign) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            return True
    return False


def map_names() -> list[str]:
    return re.findall(r"`([^`\n]+)`", MAP.read_text())


def test_every_module_and_path_the_map_names_exists() -> None:
    dotted = [n for n in map_names() if _DOTTED.match(n)]
    paths = [n for n in map_names() if _PATH.match(n)]
    assert len(dotted) >= 40 and len(paths) >= 5, "the map names too few modules to be a map"
    missing = []
    for name in dotted:
        module, _, symbol = name.partition(":")
        found = module_file(module)
        if found is None or (symbol and not defines(found, symbol)):
            missing.append(name)
    missing += [p for p in paths if not (REPO / p.rstrip("/")).exists()]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_tree_has_no_symlinks() -> None:
    tracked = [line for line in git("ls-files", "-s") if line.startswith("120000 ")]
    untracked = [p for p in git("ls-files", "--others", "--exclude-standard") if (REPO / p).is_symlink()]
    assert not tracked and not untracked, tracked + untracked


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of each import anywhere in ``path``, and ``module.name`` for each ``from`` import."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def role_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "hypha" and parts[1] in ROLES else None


def test_no_role_imports_another_role_and_the_core_imports_none() -> None:
    bad = []
    for role in ROLES:
        for path in python_files(REPO / "services" / role / "hypha"):
            for line, module in imported_modules(path):
                other = role_of(module)
                if other is not None and other != role:
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    for path in python_files(CORE):
        if path.is_relative_to(GENERATED) or path.is_relative_to(CORE / "testing"):
            continue
        for line, module in imported_modules(path):
            if role_of(module) is not None:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_production_code_never_imports_the_test_harness() -> None:
    testing = CORE / "testing"
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in python_files(CORE, REPO / "services")
        if not path.is_relative_to(testing)
        for line, module in imported_modules(path)
        if module == "hypha.testing" or module.startswith("hypha.testing.")
    ]
    assert not bad, "\n".join(bad)


def test_benchmarks_import_no_test_module() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in python_files(REPO / "benchmarks")
        for line, module in imported_modules(path)
        if module == "tests" or module.startswith("tests.")
    ]
    assert not bad, "\n".join(bad)


def test_no_hand_written_module_exceeds_800_lines() -> None:
    roots = [REPO / d for d in ("libs", "services", "tests", "benchmarks", "scripts")]
    too_long = {
        str(path.relative_to(REPO)): lines
        for path in python_files(*roots)
        if not path.is_relative_to(GENERATED) and "build" not in path.relative_to(REPO).parts
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
