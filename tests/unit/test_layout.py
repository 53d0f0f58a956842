"""The code stays easy to change: no module over 700 lines and no class over 300 (engined's two
packages and the benchmarks; tests excluded), and no import cycle among their modules, counting
every import (inside functions and under TYPE_CHECKING too). Static checks over the source, read
in a fresh interpreter: CPython 3.11's ast.parse can fail with "AST constructor recursion depth
mismatch" in a process that has met a RecursionError before (other tests provoke some)."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# source folder -> the dotted name its modules import as
PACKAGES = {"supervisor": "engined.supervisor", "engine": "engined.engine", "bench": "bench"}
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 300


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three (a package's is its __init__)."""
    found = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((dotted, *parts))] = path
    return found


def imports(path: Path, names: set[str]) -> set[str]:
    """The modules of `names` that `path` imports anywhere in its code (`from a.b import c` is
    a.b.c when that is a module, else a.b)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for target in targets:
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
                break
    return out


def facts() -> dict[str, dict[str, object]]:
    """Per module: its length, its classes' lengths, the modules of the three it imports."""
    mods = modules()
    names = set(mods)
    out: dict[str, dict[str, object]] = {}
    for name, path in mods.items():
        text = path.read_text()
        classes = {node.name: node.end_lineno - node.lineno + 1  # type: ignore[operator]
                   for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ClassDef)}
        out[name] = {"lines": len(text.splitlines()), "classes": classes,
                     "imports": sorted(imports(path, names) - {name})}
    return out


@functools.cache
def fresh_facts() -> dict[str, dict[str, object]]:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_layout; "
            "print(json.dumps(test_layout.facts()))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_no_module_or_class_too_long() -> None:
    too_long = []
    for name, fact in fresh_facts().items():
        if (lines := int(fact["lines"])) > MAX_MODULE_LINES:  # type: ignore[call-overload]
            too_long.append(f"{name}: {lines} lines")
        for cls, length in fact["classes"].items():  # type: ignore[attr-defined]
            if length > MAX_CLASS_LINES:
                too_long.append(f"{name}.{cls}: {length} lines")
    assert not too_long, too_long


def test_no_import_cycle() -> None:
    graph = {name: set(fact["imports"]) for name, fact in  # type: ignore[call-overload]
             fresh_facts().items()}
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


def test_the_checks_see_the_whole_tree() -> None:
    """A check over nothing passes: make sure these walk the real packages."""
    facts = fresh_facts()
    assert {"engined.supervisor.lifecycle.replica", "engined.supervisor.host.launcher",
            "engined.engine.core", "bench.vllm"} <= set(facts)
    worker = set(facts["engined.supervisor.lifecycle.worker"]["imports"])  # type: ignore[call-overload]
    assert {"engined.supervisor.lifecycle.replica",
            "engined.supervisor.lifecycle.incarnation"} <= worker
    assert facts["engined.supervisor.lifecycle.replica"]["classes"]["Replica"] > 100  # type: ignore
