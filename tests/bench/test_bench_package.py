"""bench/ stays a package one can read, and its results stay true to its code. Static checks and
short subprocesses: nothing runs a benchmark (the smallest runs are the `bench` marker's,
tests/bench/test_bench_*_quick.py).

- sizes: no module over 600 lines, no class over 250 (the layout's caps, bench included);
- the harness is testkit's, loaded once; engined's supervisor internals come from bench.common;
- every benchmark answers --help;
- every result in bench/results/ names the full commit it was made at and the command that made
  it; a maintained benchmark's result is not older than the benchmark's own code (bench/stale.py
  walks its imports and compares its files at that commit with HEAD); a frozen study's result
  names the commit and the command that make it again.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import stale

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
BENCHMARKS = ("core", "gateway", "vllm", "recovery", "cluster")  # the maintained ones
MODULE_MAX_LINES, CLASS_MAX_LINES = 600, 250


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under bench/ (a package's is its __init__)."""
    found = {}
    for path in sorted(BENCH.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def test_sizes() -> None:
    big = []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MODULE_MAX_LINES:
            big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None and \
                    node.end_lineno - node.lineno + 1 > CLASS_MAX_LINES:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big


def test_driver_and_supervisor_imports() -> None:
    wrong = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module if isinstance(node, ast.ImportFrom)
                      else node.names[0].name if isinstance(node, ast.Import) else "") or ""
            if module == "tests" or module.startswith("tests."):
                wrong.append(f"{name} imports {module}: the harness is `testkit`, not the tests")
            if module.startswith("engined.supervisor") and name != "bench.common":
                wrong.append(f"{name} imports {module}: take it from bench.common")
    assert not wrong, wrong


def test_every_module_imports_with_one_driver() -> None:
    names = [n for n in modules() if not n.endswith("__main__")]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(n for n, m in sys.modules.items()\n"
            "             if (getattr(m, '__file__', None) or '').endswith('testkit/driver.py')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['testkit.driver']", done.stdout


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_answers_help(name: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: python -m bench.{name}"), done.stdout[:300]


def test_results_name_their_commit_and_are_not_older_than_their_code() -> None:
    why = stale.shallow_problem()
    assert why is None, why  # a shallow clone cannot check the results: fetch the history
    problems = {path.name: found for path in stale.results()
                if (found := stale.check(path)[1])}
    assert not problems, (f"{problems}: run the benchmark again (`python -m bench.NAME`, its "
                          "full mode) and commit its result; `python -m bench.stale` lists them")
    maintained = {path.stem for path in stale.results() if "frozen" not in stale.header(path)}
    assert maintained == set(BENCHMARKS), maintained  # one current result per benchmark


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}


def test_a_result_is_older_than_what_its_code_does_not_how_it_imports() -> None:
    """A module that moved is imported from elsewhere and measures the same; a changed value
    is a changed benchmark."""
    before = "import a.b\nfrom c import d  # why\n\ndef f():\n    from e import g\n    return 2\n"
    moved = ("from x.b import b as b2\nfrom c import d\n\n\ndef f():\n    from x.e import g\n"
             "    return 2\n")
    changed = before.replace("return 2", "return 3")
    assert stale._code(before) == stale._code(moved)
    assert stale._code(before) != stale._code(changed)
