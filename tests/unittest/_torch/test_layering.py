"""The package layering of `tensorrt_llm._torch`: imports only point down, and the executor sees
speculation through `speculative.interface` alone.

    pyexecutor (loop, scheduler, engine, graph runner, creator)
        |-> speculative (interface.Drafter, DSpark worker, rejection sampler, draft graphs)
        |       |-> models -> modules -> attention_backend
        |-> pyexecutor.kv_cache (specs, block pool, KVCacheManager)
        |-> runtime (LlmRequest, step types, token rows, sampler, graph helpers)
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "tensorrt_llm" / "_torch"

ALLOWED = {
    "attention_backend": set(),
    "modules": {"attention_backend"},
    "models": {"modules", "attention_backend"},
    "runtime": {"attention_backend"},
    "pyexecutor.kv_cache": {"runtime", "attention_backend"},
    "speculative": {"runtime", "pyexecutor.kv_cache", "models", "modules", "attention_backend"},
    "pyexecutor": {"runtime", "pyexecutor.kv_cache", "speculative", "models", "modules", "attention_backend"},
}


def _node(module: str) -> str | None:
    """'tensorrt_llm._torch.pyexecutor.kv_cache.x' -> 'pyexecutor.kv_cache'; outside _torch -> None."""
    parts = module.split(".")
    if parts[:2] != ["tensorrt_llm", "_torch"] or len(parts) < 3:
        return None
    if parts[2] == "pyexecutor" and len(parts) > 3 and parts[3] == "kv_cache":
        return "pyexecutor.kv_cache"
    return parts[2]


def _imports(path: Path) -> list[str]:
    """Absolute module names `path` imports (relative imports resolved; function-level ones too)."""
    rel = path.relative_to(ROOT.parent.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append(mod)
            out.extend(f"{mod}.{a.name}" for a in node.names)   # `from . import x` names a module
    return out


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for f in ROOT.rglob("*.py"):
        src = _node("tensorrt_llm._torch." + ".".join(f.relative_to(ROOT).with_suffix("").parts))
        for m in _imports(f):
            dst = _node(m)
            if src and dst and dst != src:
                edges.setdefault((src, dst), []).append(f"{f.relative_to(ROOT)} -> {m}")
    return edges


def test_every_package_import_points_down():
    bad = {e: where for e, where in _edges().items() if e[1] not in ALLOWED.get(e[0], set())}
    assert not bad, "\n".join(f"{a} -> {b}: {w[:3]}" for (a, b), w in bad.items())


def test_no_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    for a, b in _edges():
        graph.setdefault(a, set()).add(b)
    seen, stack = set(), set()

    def visit(n: str, path: list[str]) -> None:
        if n in stack:
            pytest.fail("import cycle: " + " -> ".join(path + [n]))
        if n in seen:
            return
        seen.add(n)
        stack.add(n)
        for m in graph.get(n, ()):
            visit(m, path + [n])
        stack.discard(n)
    for n in list(graph):
        visit(n, [])


def test_executor_sees_speculation_only_through_the_interface():
    f = ROOT / "pyexecutor" / "py_executor.py"
    spec = sorted({m for m in _imports(f) if m.startswith("tensorrt_llm._torch.speculative")})
    assert spec and all(m.startswith("tensorrt_llm._torch.speculative.interface") for m in spec), spec


def test_the_checker_sees_a_forbidden_edge_negative_control(tmp_path, monkeypatch):
    """A module of `runtime` importing the executor is reported (the checker is not vacuous)."""
    bad = ROOT / "runtime" / "_layering_probe.py"
    bad.write_text("from ..pyexecutor import py_executor\n")
    try:
        edges = _edges()
    finally:
        bad.unlink()
    assert ("runtime", "pyexecutor") in edges and "pyexecutor" not in ALLOWED["runtime"]
