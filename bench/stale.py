"""Which results in bench/results/ are older than the code they measure.

    python -m bench.stale      # a table: each result, its commit, product commits since, verdict

Every result starts with the header bench/report.py writes: `- commit: SHA` (with ` + uncommitted
changes in FILES` when the tree differed), `- command: ...` (the `python -m bench.NAME` that made
it), and for a frozen study `- frozen: why` (its code has left the tree; its command checks out
the commit that makes it again). A maintained result is stale when the files its benchmark is
made of (the modules under bench/ and the testkit/ modules they import, found by walking the
imports from bench.NAME) differ between its commit and HEAD (in what they do: imports, comments
and layout aside), or were among its uncommitted changes. tests/bench/test_bench_package.py
fails on any problem this finds.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT
from bench.report import RESULTS, git, table

PRODUCT = ("supervisor", "engine")  # whose commits after a result the table counts
_SHA = re.compile(r"\b[0-9a-f]{40}\b")


def header(path: Path) -> dict[str, str]:
    """The `- key: value` lines of a result's first block (up to its first section)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("## "):
            break
        key, sep, value = line[2:].partition(": ")
        if line.startswith("- ") and sep and key not in out:
            out[key] = value
    return out


def module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def files_of(module: str) -> set[str]:
    """The files benchmark `module` is made of: its module (a package: every module in it) and,
    transitively, every bench.* and testkit.* module they import, with their packages."""
    start = module_file(module)
    if start is None:
        return set()
    todo = sorted(start.parent.rglob("*.py")) if start.name == "__init__.py" else [start]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] not in ("bench", "testkit"):
                    continue
                for i in range(1, len(parts) + 1):  # the module and the packages above it
                    found = module_file(".".join(parts[:i]))
                    if found is not None:
                        todo.append(found)
    return {str(p.relative_to(ROOT)) for p in seen}


def results() -> list[Path]:
    """Every committed-style result: bench/results/*.md but the git-ignored quick runs."""
    return sorted(p for p in RESULTS.glob("*.md") if not p.name.endswith("-quick.md"))


def shallow_problem() -> str | None:
    if git("rev-parse", "--is-shallow-repository") == "true":
        return ("this clone is shallow: the results' commits cannot be checked; fetch the "
                "history (`git fetch --unshallow`) and run again")
    return None


def check(path: Path) -> tuple[str, list[str]]:
    """(the result's commit, its problems; none: fresh, or frozen with a commit and command)."""
    head = header(path)
    commit_line, command = head.get("commit", ""), head.get("command", "")
    found = _SHA.search(commit_line)
    problems = []
    if not command:
        problems.append("names no command")
    if found is None:
        return "", problems + ["names no commit (a full 40-character sha)"]
    sha = found.group(0)
    if not is_ancestor(sha):
        return sha, problems + [f"names commit {sha[:12]}, which is not in this history"]
    if "frozen" in head:
        return sha, problems
    names = re.findall(r"python -m (bench\.[\w.]+)", command)
    if not names or not files_of(names[-1]):
        return sha, problems + [f"its command names no benchmark in this tree: {command!r}"]
    files = sorted(files_of(names[-1]))
    changed = [f for f in files if f in commit_line.partition("uncommitted changes in ")[2]
               .replace(",", " ").split()]
    if changed:
        problems.append(f"made with uncommitted changes in its own code: {', '.join(changed)}")
    differ = [f for f in git("diff", "--name-only", sha, "HEAD", "--", *files).split()
              if _code(git("show", f"{sha}:{f}")) != _code((ROOT / f).read_text())]
    if differ:
        problems.append(f"older than its code: {', '.join(differ)} changed since {sha[:12]}")
    return sha, problems


def _code(source: str) -> str:
    """What a file does, for comparing two versions of it: its syntax tree without its imports
    (a module that moved is imported from elsewhere, and measures the same), comments and
    layout; source that does not parse is compared as it is."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                kept = [n for n in block if not isinstance(n, (ast.Import, ast.ImportFrom))]
                setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree)


def is_ancestor(sha: str) -> bool:
    """Whether `sha` is a commit of this repository's history (HEAD's or before)."""
    done = subprocess.run(["git", "--no-optional-locks", "merge-base", "--is-ancestor", sha,
                           "HEAD"], cwd=ROOT, capture_output=True, timeout=30)
    return done.returncode == 0


def main() -> int:
    if (why := shallow_problem()) is not None:
        print(why)
        return 1
    print(*table("result", "commit", "date", "commits to supervisor/ or engine/ since", "state"),
          sep="\n")
    bad = 0
    for path in results():
        sha, problems = check(path)
        since = git("rev-list", "--count", f"{sha}..HEAD", "--", *PRODUCT) if sha else ""
        state = "; ".join(problems) or ("frozen" if "frozen" in header(path) else "fresh")
        bad += bool(problems)
        print(f"| {path.name} | {sha[:12] or '–'} | {header(path).get('date', '–')} | "
              f"{since or '–'} | {state} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
