"""The layout rules of ARCHITECTURE §10 and docs/architecture.md, checked over the tree.

- every module (``hypha.x.y``, ``hypha.x.y:Name``) and path the map names exists;
- no symlinks in the tree (``git ls-files -s`` mode 120000, or untracked ones);
- a role imports only the core library, never another role; the core imports no role, not even
  by name at run time (``__import__``, ``importlib.import_module``): a role starts another as a
  process. The harness (``hypha.testing``, its own distribution in ``libs/testing``) drives roles;
- production code never imports ``hypha.testing``, and benchmarks never import ``tests``;
- no production module exceeds 400 lines unless ``LONG_MODULES`` says why; no test, benchmark
  or script exceeds 800 (generated ``libs/hypha/v1`` excepted).
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "architecture.md"
ROLES = ("gateway", "scheduler", "worker", "data", "client")
CORE = REPO / "libs" / "hypha"
GENERATED = CORE / "v1"
#: The test harness: its own distribution in the ``hypha`` namespace (``libs/testing/pyproject.toml``).
TESTING = REPO / "libs" / "testing" / "hypha" / "testing"
#: A production module (core, roles, harness) past this holds more than one concept: split it.
MAX_LINES = 400
#: Tests, benchmarks and scripts: many cases of one subject read best side by side.
MAX_SUITE_LINES = 800
#: Production modules that earn more than ``MAX_LINES``, each with why; one that shrinks below
#: the cap leaves the list (the test says so).
LONG_MODULES = {
    # One concept each whose parts only make sense together; splitting would scatter one protocol.
    "libs/hypha/net/relay.py": "the relay protocol: both ends of one circuit and its frames",
    "libs/hypha/pki/crl.py": "revocation lists: issue, sign, verify, refresh in one trust rule",
    "libs/hypha/pki/certs.py": "certificate issuing for every role: one profile table and its checks",
    "libs/hypha/dht/protocol.py": "the Kademlia RPCs and their verification, one wire protocol",
    "libs/hypha/dht/node.py": "the DHT node's lifecycle around the protocol (lookup/cache live apart)",
    "libs/hypha/dht/records.py": "the signed provider record: encoding, signing, every check",
    "libs/hypha/bridge_client/client.py": "every job-bridge call an executor makes, one typed client",
    "libs/hypha/datasets/format.py": "the dataset format: manifest, slices and their checks",
    "libs/testing/hypha/testing/compose_chaos.py": "the container chaos harness: one scenario driver",
    "services/worker/hypha/worker/transfer.py": "the worker's tensor transfer: send, receive, retry",
    "services/worker/hypha/worker/bridge.py": "the job bridge's REST surface, one route per call",
    "services/worker/hypha/worker/executors/parameter_server.py": "one executor's whole job loop",
    "services/worker/hypha/worker/executors/diloco_trainer.py": "one executor's whole job loop",
    "services/client/hypha/client/demo.py": "the demo script, one story from cluster to plot",
    "services/scheduler/hypha/scheduler/sqlite_store.py": "every store query on one SQLite schema",
    "services/scheduler/hypha/scheduler/runs.py": "the JobRun interface and the leasing every run shares",
    "services/scheduler/hypha/scheduler/servicer.py": "the Scheduler gRPC service, one method each",
    "services/scheduler/hypha/scheduler/market.py": "the scheduler's side of the market protocol",
    "services/scheduler/hypha/scheduler/diloco/round_planner.py": "the round planner, one algorithm",
    "services/scheduler/hypha/scheduler/diloco/slice_tracker.py": "the slice state machine and its book",
    "services/gateway/hypha/gateway/hub.py": "the hub's routing: one frame switch",
}

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
    bases = [CORE, TESTING.parent]
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
        if path.is_relative_to(GENERATED):
            continue
        for line, module in imported_modules(path):
            if role_of(module) is not None:
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


_LOADERS = {"__import__", "import_module"}


def dynamic_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) of each ``__import__`` call, and of each ``importlib.import_module`` whose
    argument names a module by a literal (or an f-string's literal start) the static check cannot see."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name not in _LOADERS:
            continue
        arg = node.args[0] if node.args else None
        literal = ""
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            literal = arg.value
        elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            literal = str(arg.values[0].value)
        if name == "__import__":
            yield node.lineno, f"__import__({literal or '...'})"
        elif literal:
            yield node.lineno, f"import_module({literal})"


def test_no_role_or_core_module_loads_a_role_by_name() -> None:
    """A module named at run time escapes the import check above: ``__import__`` is refused
    outright, ``import_module`` when its literal names a role other than the caller's own
    (the core's ``hypha.cli.node`` loads the ``build`` a role hands it, a variable: allowed)."""
    bad = []
    for owner, root in [(None, CORE), *((role, REPO / "services" / role / "hypha") for role in ROLES)]:
        for path in python_files(root):
            if path.is_relative_to(GENERATED):
                continue
            for line, what in dynamic_imports(path.read_text()):
                named = role_of(what.partition("(")[2].rstrip(")").rstrip("."))
                if what.startswith("__import__") or (named is not None and named != owner):
                    bad.append(f"{path.relative_to(REPO)}:{line} {what}")
    assert not bad, "\n".join(bad)


def test_the_dynamic_import_check_sees_each_form() -> None:
    source = (
        "import importlib\n"
        "__import__('hypha.worker.cli', fromlist=['main'])\n"
        "importlib.import_module('hypha.scheduler.config')\n"
        "importlib.import_module(f'hypha.gateway.{name}')\n"
        "importlib.import_module(module)\n"
    )
    found = [what for _, what in dynamic_imports(source)]
    assert found == [
        "__import__(hypha.worker.cli)",
        "import_module(hypha.scheduler.config)",
        "import_module(hypha.gateway.)",
    ]
    assert [role_of(w.partition("(")[2].rstrip(")").rstrip(".")) for w in found] == [
        "worker",
        "scheduler",
        "gateway",
    ]


def test_production_code_never_imports_the_test_harness() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in python_files(CORE, REPO / "services")
        for line, module in imported_modules(path)
        if module == "hypha.testing" or module.startswith("hypha.testing.")
    ]
    assert not bad, "\n".join(bad)


def test_the_core_distribution_ships_no_harness() -> None:
    """The core's package find (root pyproject, ``where = ["libs"]``) must not reach the harness."""
    assert not (CORE / "testing").exists(), "hypha.testing lives in libs/testing (its own distribution)"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    assert "hypha.testing*" in find.get("exclude", [])
    harness = tomllib.loads((REPO / "libs" / "testing" / "pyproject.toml").read_text())
    assert harness["tool"]["setuptools"]["packages"]["find"]["include"] == ["hypha.testing*"]


def test_benchmarks_import_no_test_module() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in python_files(REPO / "benchmarks")
        for line, module in imported_modules(path)
        if module == "tests" or module.startswith("tests.")
    ]
    assert not bad, "\n".join(bad)


def line_counts(*dirs: str) -> dict[str, int]:
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for path in python_files(*(REPO / d for d in dirs))
        if not path.is_relative_to(GENERATED) and "build" not in path.relative_to(REPO).parts
    }


def test_no_production_module_exceeds_400_lines_unless_it_says_why() -> None:
    counts = line_counts("libs", "services")
    too_long = {p: n for p, n in counts.items() if n > MAX_LINES and p not in LONG_MODULES}
    assert not too_long, f"modules over {MAX_LINES} lines (split, or say why in LONG_MODULES): {too_long}"
    stale = sorted(p for p in LONG_MODULES if counts.get(p, 0) <= MAX_LINES)
    assert not stale, f"LONG_MODULES names modules gone or under {MAX_LINES} lines: {stale}"


def test_no_test_benchmark_or_script_exceeds_800_lines() -> None:
    too_long = {p: n for p, n in line_counts("tests", "benchmarks", "scripts").items() if n > MAX_SUITE_LINES}
    assert not too_long, f"modules over {MAX_SUITE_LINES} lines: {too_long}"
