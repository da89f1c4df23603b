"""The import layers of the package, enforced: nothing imports upward, nothing imports in a circle.

From the bottom (docs/architecture.md draws the same picture)::

    tools       zmq_rollout.cli, .demo, .local, .top, .gateway   (import the services lazily, in functions)
    services    zmq_rollout.broker.*  |  zmq_rollout.workers.*     (never each other)
    client      zmq_rollout.client, .blocking, .rollouts, .sync_methods, .submissions, .liveness,
                .testing, .fuzzing, .fuzz_templates, .fuzz_peers, .episodes, .env_hosts, .chat_tokens,
                .environments.*,
                and the package's __init__
    data plane  zmq_rollout.weight_sync.*
    base        zmq_rollout.protocol.*, .codec, .errors, .config, .settings, .batching, .metrics, .tiny_model,
                .curve, .scrape

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"zmq_rollout": ROOT / "zmq_rollout", "zmq_rollout.broker": ROOT / "broker",
                "zmq_rollout.workers": ROOT / "workers"}  # fmt: skip  (pyproject's package-dir)

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("zmq_rollout.protocol", "zmq_rollout.codec", "zmq_rollout.errors", "zmq_rollout.config",
              "zmq_rollout.settings", "zmq_rollout.batching", "zmq_rollout.metrics", "zmq_rollout.tiny_model",
              "zmq_rollout.curve", "zmq_rollout.scrape", "zmq_rollout.gc_pauses")),
    ("data plane", ("zmq_rollout.weight_sync",)),
    ("client", ("zmq_rollout.client", "zmq_rollout.blocking", "zmq_rollout.rollouts", "zmq_rollout.testing",
                "zmq_rollout.fuzzing", "zmq_rollout.fuzz_templates", "zmq_rollout.fuzz_peers",
                "zmq_rollout.sync_methods", "zmq_rollout.submissions", "zmq_rollout.liveness", "zmq_rollout.episodes",
                "zmq_rollout.env_hosts", "zmq_rollout.chat_tokens", "zmq_rollout.environments", "zmq_rollout")),
    ("services", ("zmq_rollout.broker", "zmq_rollout.workers")),
    ("tools", ("zmq_rollout.cli", "zmq_rollout.demo", "zmq_rollout.local", "zmq_rollout.top", "zmq_rollout.gateway",
               "zmq_rollout.integrations")),
]  # fmt: skip
SERVICES = ("zmq_rollout.broker", "zmq_rollout.workers")


def modules() -> dict[str, Path]:
    """Every module of the installed package, by its import name."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if package == "zmq_rollout" and rel[0] in ("broker", "workers"):
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            found[".".join((package, *parts))] = path
    return found


MODULES = modules()


def layer_of(module: str) -> tuple[int, str]:
    """(level, owner) of the most specific layer entry that ``module`` falls under."""
    best = (-1, "", "")
    for level, (_, owners) in enumerate(LAYERS):
        for owner in owners:
            if (module == owner or module.startswith(owner + ".")) and len(owner) > len(best[2]):
                best = (level, owner, owner)
    if best[0] < 0:
        raise AssertionError(f"module {module} is in no layer: add it to LAYERS")
    return best[0], best[1]


def imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported package module, line, runs on import) for every import of ours in ``path``:
    the third is False inside functions and under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from pkg import sub`` imports the submodule when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            if name == "zmq_rollout" or name.startswith("zmq_rollout."):
                target = name
                while target not in MODULES:  # ``zmq_rollout.protocol.Struct`` -> ``zmq_rollout.protocol``
                    target = target.rpartition(".")[0]
                found.append((target, node.lineno, id(node) in top_level))
    return found


GRAPH = {m: imports(m, path) for m, path in MODULES.items()}


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_nothing_imports_upward() -> None:
    wrong = []
    for module, found in GRAPH.items():
        level, _ = layer_of(module)
        for target, line, _ in found:
            target_level, _ = layer_of(target)
            if target_level > level:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} ({LAYERS[level][0]}) "
                             f"imports {target} ({LAYERS[target_level][0]})")  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_services_do_not_import_each_other() -> None:
    wrong = [
        f"{module} imports {target}"
        for module, found in GRAPH.items()
        for target, _, _ in found
        for a, b in (SERVICES, SERVICES[::-1])
        if module.startswith(a) and target.startswith(b)
    ]
    assert not wrong, "\n".join(wrong)


def test_tools_import_the_services_only_when_they_run() -> None:
    wrong = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {target} at module level"
        for module, found in GRAPH.items()
        if layer_of(module)[0] == len(LAYERS) - 1
        for target, line, top in found
        if top and target.startswith(SERVICES)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    edges = {m: {t for t, _, _ in found if t != m} for m, found in GRAPH.items()}
    # A package's __init__ re-exporting its own submodules is containment, not a cycle.
    for m, targets in edges.items():
        edges[m] = {t for t in targets if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "module", ["zmq_rollout", "zmq_rollout.cli", "zmq_rollout.local", "zmq_rollout.demo", "zmq_rollout.top"]
)
def test_importing_the_library_and_tools_loads_no_service_torch_or_vllm(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm') "
        "or m.startswith(('zmq_rollout.broker', 'zmq_rollout.workers'))); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
