"""bench/ stays a package one can read (module and class sizes and import cycles are checked with
engined's packages, tests/unit/test_layout.py): the daemon driver is testkit's, loaded once;
engined's supervisor internals are imported in bench/common.py only; every documented entry
point answers --help. Static checks and short subprocesses: nothing runs a benchmark (the quick
runs are the `bench` marker's, tests/bench/test_bench_*_quick.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
# every `python -m bench.NAME` that the READMEs, .ci/run and the tests name, with --help
ENTRY_POINTS = ("core", "gateway", "recovery", "upgrade", "vllm")


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module under bench/ (a package's is its __init__)."""
    found = {}
    for path in sorted(BENCH.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


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
    """Every bench module imported in one process: testkit/driver.py is loaded once, as
    `testkit.driver`."""
    names = [n for n in modules() if not n.endswith("__main__")
             and n not in ("bench.core.floor", "bench.vllm_direct")]  # stdlib-only children
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(n for n, m in sys.modules.items()\n"
            "             if (getattr(m, '__file__', None) or '').endswith('testkit/driver.py')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['testkit.driver']", done.stdout


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_answers_help(name: str) -> None:
    done = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: python -m bench.{name}"), done.stdout[:300]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
