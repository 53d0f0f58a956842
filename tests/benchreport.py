"""Reading a benchmark's markdown report in the quick-mode tests: sections and tables."""

from __future__ import annotations

import re


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
