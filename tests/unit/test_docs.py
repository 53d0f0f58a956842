"""What the README and the pages under docs/ show is what the code takes: every `engined` and
`enginectl` command in a fenced shell block parses with the real argument parsers (parsed only,
never run), every fleet spec in a fenced YAML block (one with `engines:` or `version: 1`)
validates with the real spec loader, every metric the daemon exports is listed on the
observability page, and the README's links lead to files that exist.

A YAML block that is only part of a spec is marked by an HTML comment starting with
`<!-- fragment` on the line before it. Specs are checked with `parse_fleet`, the loader's checks
that need no file on this machine: the interpreters, token files, model directories and
programs they name belong to the host the spec is for (`engined --check` checks those there).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from engined.supervisor.spec import SpecError, parse_fleet

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHELLS = ("sh", "bash", "shell", "console")
FRAGMENT = "<!-- fragment"
# commands that run the next word as a command: their options come first
WRAPPERS = ("sudo", "exec", "srun", "nohup", "env")
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_SEPARATORS = set(";&|()<>")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based, the opening fence's
    lang: str
    text: str
    fragment: bool

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    """The fenced code blocks of a Markdown page."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = [line.removeprefix(indent) for line in lines[i + 1:end]]
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        yield Block(page, i + 1, lang, "\n".join(body) + "\n",
                    before.strip().startswith(FRAGMENT))
        i = end + 1


ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]


# Commands ------------------------------------------------------------------------------------


def command_lines(block: Block) -> list[str]:
    """A shell block's command lines: in a transcript (lines starting `$ `) only those, with
    backslash continuations joined."""
    lines = block.text.splitlines()
    if block.lang == "console" or any(line.startswith("$ ") for line in lines):
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line)
    return joined


def simple_commands(line: str) -> list[list[str]]:
    """`a x && b y | c` -> [[a, x], [b, y], [c]] (comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= _SEPARATORS:
            out.append([])
        else:
            out[-1].append(token)
    return [words for words in out if words]


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, arguments) when the words run engined or enginectl, past environment
    assignments and wrappers (`sudo`, `srun --nodes=4`, ...)."""
    rest = list(words)
    while rest and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", rest[0]) or rest[0] in WRAPPERS):
        wrapper = rest.pop(0)
        while wrapper in WRAPPERS and rest and rest[0].startswith("-"):
            rest.pop(0)
    if not rest:
        return None
    program = rest[0].rsplit("/", 1)[-1]
    return (program, rest[1:]) if program in ("engined", "enginectl") else None


def _parsers() -> dict[str, Callable[[list[str]], Any]]:
    """The real argument parsers, found through the console scripts' modules."""
    scripts = {ep.name: ep for ep in entry_points(group="console_scripts")
               if ep.name in ("engined", "enginectl")}
    daemon = importlib.import_module(scripts["engined"].module)
    ctl = importlib.import_module(scripts["enginectl"].module)
    return {"engined": daemon._parse_args, "enginectl": lambda argv: ctl.build_parser()
            .parse_args(argv)}


def shown_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for block in ALL_BLOCKS:
        if block.lang not in SHELLS:
            continue
        for line in command_lines(block):
            for words in simple_commands(line):
                if (run := invocation(words)) is not None:
                    found.append((block.where(), *run))
    return found


COMMANDS = shown_commands()


def test_the_pages_show_commands() -> None:
    """A check over nothing passes: the extraction must find the commands the pages show."""
    programs = {program for _, program, _ in COMMANDS}
    assert programs == {"engined", "enginectl"} and len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize(("where", "program", "args"), COMMANDS,
                         ids=[f"{w} {p} {' '.join(a)}" for w, p, a in COMMANDS])
def test_every_command_shown_parses(where: str, program: str, args: list[str]) -> None:
    parse = _parsers()[program]
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(args)
        except SystemExit as exc:  # --version and --help exit 0; a usage error exits 2
            assert exc.code == 0, f"{where}: `{program} {shlex.join(args)}`: {errors.getvalue()}"


# Fleet specs ---------------------------------------------------------------------------------

# the spec reference's examples are parts of specs, checked whole by test_spec_reference.py
REFERENCE = REPO / "docs" / "reference" / "spec.md"
SPECS = [b for b in ALL_BLOCKS if b.lang in ("yaml", "yml") and b.page != REFERENCE
         and re.search(r"^(\s*engines:|version: 1\b)", b.text, re.MULTILINE)]


def test_fragments_are_few() -> None:
    fragments = [b.where() for b in SPECS if b.fragment]
    assert len(fragments) <= 3, f"make these whole specs: {fragments}"
    assert len(SPECS) - len(fragments) >= 5


@pytest.mark.parametrize("block", [b for b in SPECS if not b.fragment],
                         ids=lambda b: b.where())
def test_every_spec_shown_is_valid(block: Block) -> None:
    try:
        parse_fleet(block.text, block.where())
    except SpecError as exc:
        pytest.fail(f"{block.where()}: the spec shown is invalid:\n{exc}")


# Metrics and links ---------------------------------------------------------------------------


def test_every_metric_is_on_the_observability_page() -> None:
    page = (REPO / "docs" / "observability.md").read_text()
    source = "\n".join(p.read_text() for p in (REPO / "supervisor").rglob("*.py"))
    names = set(re.findall(r'"(engined_[a-z_]+)"', source))
    assert len(names) > 30, names  # the families' names as the collector declares them
    missing = sorted(n for n in names if f"`{n}`" not in page and f"`{n}_total`" not in page)
    assert not missing, f"docs/observability.md does not list {missing}"


def test_the_readmes_links_lead_somewhere() -> None:
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert not missing, missing


def test_the_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
