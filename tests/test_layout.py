"""The layout's import rules (docs/architecture.md, "What each package may import"), read from
the source: a change that breaks one fails here, not in a reviewer's head."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "graft_fed"


def _imports() -> dict[str, set[str]]:
    """module -> every module it imports (absolute names, lazy imports included)."""
    out: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        if "proto" in path.relative_to(PKG).parts:
            continue
        module = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[module] = names
    return out


IMPORTS = _imports()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _uses(module: str, prefix: str) -> bool:
    return any(n == prefix or n.startswith(prefix + ".") for n in IMPORTS[module])


#: package -> packages of graft_fed it must never import (the data path runs one way:
#: core <- trainer <- graft <- node; broker and node share only federation).
FORBIDDEN = {
    "core": {"trainer", "graft", "node", "broker", "federation", "rollout", "rewards", "data", "store", "modeling"},
    **{low: {"trainer", "graft", "node", "broker", "federation", "sim", "experiment", "cli"}
       for low in ("data", "rewards", "rollout", "store")},
    "trainer": {"graft", "node", "broker", "federation", "sim", "experiment", "cli"},
    "graft": {"node", "broker", "federation", "sim", "experiment", "cli"},
    "node": {"broker", "sim", "experiment", "cli"},
    "broker": {"node", "graft", "trainer", "sim", "experiment", "cli"},
    "federation": {"broker", "node", "graft", "trainer", "sim", "experiment", "cli"},
}


def test_packages_import_only_what_the_layout_allows():
    bad = [f"{m} imports graft_fed.{p}" for m in sorted(IMPORTS) for p in FORBIDDEN.get(_package(m), ())
           if _uses(m, f"graft_fed.{p}")]
    assert not bad, "\n".join(bad)


def test_grpc_and_the_generated_code_stay_at_the_transport_edge():
    # the servicer, server and front (broker), the client (node), and the codec, status table and
    # channel set-up shared by both; the node's logic and the domain errors see neither
    allowed = {"graft_fed.broker.servicer", "graft_fed.broker.server", "graft_fed.broker.auth", "graft_fed.broker.front",
               "graft_fed.node.client", "graft_fed.federation.codec", "graft_fed.federation.status",
               "graft_fed.federation.transport"}
    users = {m for m in IMPORTS if _uses(m, "grpc") or _uses(m, "graft_fed.proto")}
    assert users <= allowed, sorted(users - allowed)
    assert "graft_fed.federation.errors" not in users and "graft_fed.node.node" not in users


def test_no_import_cycle_between_files():
    modules = set(IMPORTS)

    def target(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    # a package's __init__ is not an edge target: importing graft_fed.x.y runs it, but it
    # holds no code here that imports back
    edges = {m: {t for n in IMPORTS[m] if (t := target(n)) and t != m and t != "graft_fed" and
                 not (PKG.parent / (t.replace(".", "/") + "/__init__.py")).is_file()} for m in modules}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)


def test_the_rules_see_real_imports():
    """The checks above would pass vacuously if the parser found nothing."""
    assert _uses("graft_fed.node.node", "graft_fed.graft.step")
    assert _uses("graft_fed.graft.step", "graft_fed.trainer.grpo")
    assert _uses("graft_fed.broker.handlers", "graft_fed.federation.messages")
    assert _uses("graft_fed.node.client", "grpc")


def test_the_broker_does_not_load_torch():
    """`graft-fed broker` (its parser included) needs none of torch: loading it cost the broker
    seconds at every start, ~190 MiB, and 180,000 objects that each full garbage collection
    walked with the GIL held while heartbeats waited (docs/performance.md, issue 13 fourth pass)."""
    import os
    import subprocess
    import sys

    code = ("import sys, graft_fed.cli, graft_fed.broker.server, graft_fed.broker.handlers; "
            "graft_fed.cli.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent, env={**os.environ, "PYTHONPATH": str(PKG.parent)}, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
