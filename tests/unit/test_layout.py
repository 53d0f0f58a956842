"""The code stays easy to change: no module over 700 lines and no class over 300 (engined's two
packages and the benchmarks; tests excluded), and no import cycle among their modules, counting
every import (inside functions and under TYPE_CHECKING too). The layering rules
(docs/architecture.md) are checked here too: which package may import which, and that only
`Replica` assigns a replica's fields. Static checks over the source, read in a fresh interpreter:
CPython 3.11's ast.parse can fail with "AST constructor recursion depth mismatch" in a process
that has met a RecursionError before (other tests provoke some)."""

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
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 250
MAX_CHAIN = 13  # modules in the longest import chain (21 at 28027b8, before wave 4's layering)


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
    """Per module: its length, its classes' lengths, the modules of the three it imports, the
    attributes each class assigns on `self`, and every attribute it assigns on anything else
    ([line, attribute])."""
    mods = modules()
    names = set(mods)
    out: dict[str, dict[str, object]] = {}
    for name, path in mods.items():
        text = path.read_text()
        tree = ast.parse(text)
        classes = {node.name: node.end_lineno - node.lineno + 1  # type: ignore[operator]
                   for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        own = {node.name: sorted({t.attr for t in _assigned(node) if _on_self(t)})
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        others = sorted({(t.lineno, t.attr) for t in _assigned(tree) if not _on_self(t)})
        out[name] = {"lines": len(text.splitlines()), "classes": classes,
                     "imports": sorted(imports(path, names) - {name}), "self_fields": own,
                     "other_writes": others}
    return out


def _assigned(tree: ast.AST) -> list[ast.Attribute]:
    """Every attribute `tree` assigns (plain, augmented, annotated, in tuples)."""
    found: list[ast.Attribute] = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(item, ast.Attribute):
                    found.append(item)
    return found


def _on_self(target: ast.Attribute) -> bool:
    return isinstance(target.value, ast.Name) and target.value.id == "self"


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


# --- layering (docs/architecture.md) -----------------------------------------------------------
S = "engined.supervisor."
# importer prefix -> what it must never import (prefixes)
FORBIDDEN = {
    S + "host": (S + "lifecycle", S + "upgrade", S + "gateway", S + "observe", S + "control",
                 S + "ctl", S + "daemon", S + "services", S + "routing"),
    S + "spec": (S + "host", S + "lifecycle", S + "upgrade", S + "gateway", S + "observe",
                 S + "control", S + "ctl", S + "daemon", S + "services", S + "routing"),
    S + "lifecycle": (S + "upgrade", S + "gateway", S + "observe", S + "control", S + "ctl",
                      S + "daemon", S + "services", S + "routing"),
    S + "observe": (S + "gateway.app",),
    S + "ctl": (S + "lifecycle", S + "upgrade", S + "gateway", S + "observe", S + "control",
                S + "daemon", S + "services", S + "routing", S + "host"),
    "engined.engine": (S.rstrip("."),),
}
# the gateway sees routing and the lifecycle's immutable views only
GATEWAY_MAY_SEE = (S + "lifecycle.view", S + "lifecycle.state", S + "lifecycle.notices")


def _edges() -> list[tuple[str, str]]:
    return [(name, dep) for name, fact in fresh_facts().items()
            for dep in fact["imports"]]  # type: ignore[attr-defined]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_layers_import_only_downwards() -> None:
    wrong = [f"{name} imports {dep}" for name, dep in _edges()
             for importer, banned in FORBIDDEN.items()
             if _under(name, importer) and any(_under(dep, b) for b in banned)]
    wrong += [f"{name} imports {dep}: the gateway sees routing and immutable views only"
              for name, dep in _edges() if _under(name, S + "gateway")
              and _under(dep, S + "lifecycle") and dep not in GATEWAY_MAY_SEE]
    assert not wrong, wrong


def test_only_replica_assigns_a_replicas_fields() -> None:
    """The lifecycle has one door: no code but `Replica`'s own methods assigns a field of a
    replica (a worker, a hand-over, the fleet call its methods). Judged by name: an attribute
    Replica keeps on `self`, assigned on anything but `self`, anywhere in engined.supervisor
    outside lifecycle/replica.py."""
    facts = fresh_facts()
    fields = set(facts[S + "lifecycle.replica"]["self_fields"]["Replica"])  # type: ignore
    assert {"state", "current", "incarnation", "spec", "owner"} <= fields, fields
    wrong = [f"{name}:{line} assigns .{attr}" for name, fact in facts.items()
             if _under(name, S.rstrip(".")) and name != S + "lifecycle.replica"
             for line, attr in fact["other_writes"]  # type: ignore[attr-defined]
             if attr in fields]
    assert not wrong, wrong


def test_the_longest_import_chain() -> None:
    """Printed (pytest -s shows it), and bounded: a long chain is code that cannot be read or
    imported alone."""
    graph = {name: set(fact["imports"]) for name, fact in fresh_facts().items()  # type: ignore
             if not name.startswith("bench")}

    @functools.cache
    def longest(name: str) -> tuple[str, ...]:
        chains = [(name, *longest(dep)) for dep in graph[name] if dep in graph]
        return max(chains, key=len, default=(name,))

    chain = max((longest(name) for name in graph), key=len)
    print(f"the longest import chain, {len(chain)} modules: {' -> '.join(chain)}")
    assert len(chain) <= MAX_CHAIN, chain
