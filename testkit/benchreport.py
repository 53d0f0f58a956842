"""Reading a benchmark's markdown report in the quick-mode tests (sections and tables), and
running the vLLM benchmark's quick mode for them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def sections(text: str) -> dict[str, str]:
    """Markdown split at `## ` headings: heading (without the `## `) -> body."""
    parts = re.split(r"^## (.*)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def section(secs: dict[str, str], prefix: str) -> str:
    found = [body for heading, body in secs.items() if heading.startswith(prefix)]
    assert len(found) == 1, f"expected one section {prefix!r}, headings: {list(secs)}"
    return found[0]


def tables(body: str) -> list[list[list[str]]]:
    """Each markdown table of a section: its rows (header and separator excluded) as cells."""
    out: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in body.splitlines():
        if line.startswith("| "):
            if current is None:
                current = []
                out.append(current)
            current.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        else:
            current = None
    return [rows[2:] for rows in out]


def run_quick(module: str, out: Path, timeout_s: float, *extra: str,
              printed: bool = False, leftovers: bool = True) -> str:
    """`python -m bench.MODULE --quick [extra...] --out OUT` in a clean environment (no
    ENGINED_* variable, no PYTHONPATH: the installed package runs): it must exit 0 and leave
    no process behind (`leftovers`: its report says so); `printed`: it must also print the
    tables it writes. Returns the report."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ENGINED_") and k not in ("NOTIFY_SOCKET", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-m", f"bench.{module}", "--quick", *extra,
                           "--out", str(out)], cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    text = out.read_text()
    if printed:
        assert text in done.stdout.replace("\r", "")  # the same tables were printed
    if leftovers:
        assert "processes left over and killed by pid: none" in text, text[-500:]
    return text


def run_quick_vllm_bench(out: Path, vllm_python: str, timeout_s: float,
                         *extra: str) -> str:
    """`python -m bench.vllm --quick [extra...]` (run_quick), printing its tables."""
    return run_quick("vllm", out, timeout_s, *extra, "--vllm-python", vllm_python,
                     printed=True)
