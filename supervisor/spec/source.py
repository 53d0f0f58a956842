"""Stages 1 and 2: bytes -> text -> plain values plus a key-path -> line map.

A bounded SafeLoader composes the YAML nodes (depth and node-count limits, duplicate-key
detection, basic scalar tags only); the walker expands aliases (counting every visit) and records
each key path's line for the problems reported later.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from engined.supervisor.spec.model import SpecError, SpecProblem

MAX_SPEC_BYTES = 1 << 20
MAX_NODES = 100_000  # composed nodes, and node visits with aliases expanded ("billion laughs")
MAX_DEPTH = 64  # the fleet spec needs ~5; the pure-Python composer recurses ~3 frames a level
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


# ---------------------------------------------------------------------------------------------
# Stage 1: bytes -> text


def _decode(text: str | bytes, source: str) -> str:
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        _check_size(len(data), source)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            message = f"not valid UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start}"
            raise SpecError([SpecProblem(source, "", line, message)]) from None
    if not isinstance(text, str):
        raise TypeError(f"fleet spec text must be str or bytes, not {type(text).__name__}")
    _check_size(len(text), source)  # chars <= bytes, so this cheap check goes first
    _check_size(len(text.encode("utf-8", "surrogatepass")), source)
    return text


def _check_size(size: int, source: str) -> None:
    if size > MAX_SPEC_BYTES:
        message = f"fleet spec is too large (more than {MAX_SPEC_BYTES} bytes)"
        raise SpecError([SpecProblem(source, "", None, message)])


# ---------------------------------------------------------------------------------------------
# Stage 2: text -> plain values and a line map


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses deep nesting and huge documents before they cost stack
    or memory (the stock composer recurses once per nesting level and has no size limit)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            self._refuse(f"document has more than {MAX_NODES} YAML nodes")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                self._refuse(f"nesting deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _refuse(self, problem: str) -> None:
        raise yaml.composer.ComposerError(None, None, problem, self.peek_event().start_mark)


def _compose(text: str, source: str) -> tuple[Any, dict[str, int]]:
    node = _compose_node(text, source)
    if node is None:
        raise SpecError(
            [
                SpecProblem(
                    source, "", None, "fleet spec is empty (expected a mapping with version: 1)"
                )
            ]
        )
    walker = _Walker()
    try:
        value = walker.value(node, "", 0)
    except _Abort as abort:
        walker.problems.append(SpecProblem(source, abort.path, abort.line, abort.message))
    except RecursionError:  # only when called from an already deep stack: MAX_DEPTH bounds the walk
        walker.problems.append(SpecProblem(source, "", None, "YAML nesting too deep"))
    problems = [SpecProblem(source, p.path, p.line, p.message) for p in walker.problems]
    if problems:
        raise SpecError(problems)
    return value, walker.lines


def _compose_node(text: str, source: str) -> Node | None:
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text)  # the reader rejects non-printable characters right here
        return loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_marked_problem(exc, source)]) from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        raise SpecError([SpecProblem(source, "", line, str(exc).split("\n")[0])]) from None
    except RecursionError:  # only when called from an already deep stack; the limits stop the rest
        raise SpecError([SpecProblem(source, "", None, "YAML nesting too deep")]) from None
    except Exception as exc:  # noqa: BLE001 - the parser is a black box fed hostile input
        raise SpecError(
            [SpecProblem(source, "", None, f"cannot parse YAML: {type(exc).__name__}: {exc}")]
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def _marked_problem(exc: yaml.MarkedYAMLError, source: str) -> SpecProblem:
    mark = exc.problem_mark or exc.context_mark
    context = exc.context
    if (
        context
        and exc.context_mark
        and exc.problem_mark
        and exc.context_mark.line != exc.problem_mark.line
    ):
        context += f" (line {exc.context_mark.line + 1})"  # e.g. where an unclosed quote began
    text = ": ".join(part for part in (context, exc.problem) if part)
    if mark is None:
        return SpecProblem(source, "", None, f"YAML error: {text}")
    return SpecProblem(source, "", mark.line + 1, f"YAML error: {text} (column {mark.column + 1})")


class _Abort(Exception):
    """Stops the walk: the document is too big or too deep to look at any further."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(message)
        self.path, self.line, self.message = path, line, message


_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str"))


class _Walker:
    """Turns a composed node graph into plain dict/list/scalars, recording each key path's line.

    Aliases are expanded here, so every visit is counted (the composer only counted distinct
    nodes); recursive aliases are caught by tracking the nodes on the current path.
    """

    def __init__(self) -> None:
        self.lines: dict[str, int] = {}
        self.problems: list[SpecProblem] = []  # file filled in by the caller
        self._visits = 0
        self._open: set[int] = set()
        self._constructor = yaml.constructor.SafeConstructor()  # for scalars only

    def value(self, node: Node, path: str, depth: int) -> Any:
        line = node.start_mark.line + 1
        self._visits += 1
        if self._visits > MAX_NODES:
            raise _Abort(
                path, line, f"document expands to more than {MAX_NODES} YAML nodes (alias bomb?)"
            )
        if depth > MAX_DEPTH:
            raise _Abort(path, line, f"nesting deeper than {MAX_DEPTH} levels")
        self.lines.setdefault(path, line)  # a mapping value keeps its key's line
        if isinstance(node, ScalarNode):
            return self._scalar(node, path)
        if id(node) in self._open:
            raise _Abort(path, line, "recursive YAML alias")
        self._open.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return self._sequence(node, path, depth)
            assert isinstance(node, MappingNode)  # the composer makes only these three kinds
            return self._mapping(node, path, depth)
        finally:
            self._open.discard(id(node))

    def _problem(self, path: str, node: Node, message: str) -> None:
        self.problems.append(SpecProblem("", path, node.start_mark.line + 1, message))

    def _scalar(self, node: ScalarNode, path: str) -> Any:
        if node.tag in (_TAG + "timestamp", _TAG + "value", _TAG + "merge"):
            return (
                node.value
            )  # implicit tags of plain text (a date, "=", "<<"): keep what was written
        if node.tag not in _SCALAR_TAGS:
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
            return None
        try:
            value = self._constructor.yaml_constructors[node.tag](self._constructor, node)
        except Exception as exc:  # noqa: BLE001 - e.g. !!int "x", or an int past Python's digit limit
            detail = f": {str(exc).split(';')[0]}" if isinstance(exc, ValueError) else ""
            self._problem(
                path, node, f"invalid {node.tag[len(_TAG) :]} value {_show(node.value)}{detail}"
            )
            return None
        if isinstance(value, str) and _SURROGATE_RE.search(value):
            self._problem(path, node, "string contains an invalid unicode escape (surrogate)")
            return None
        return value

    def _sequence(self, node: SequenceNode, path: str, depth: int) -> list[Any]:
        if node.tag != _TAG + "seq":
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
        return [self.value(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value)]

    def _mapping(self, node: MappingNode, path: str, depth: int) -> dict[str, Any]:
        if node.tag != _TAG + "map":
            self._problem(path, node, f"unsupported YAML tag {_tag_name(node.tag)}")
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, path)
            if key is None:
                continue
            sub = _join(path, key)
            if key in out:  # PyYAML silently keeps the last one; a typo'd copy would hide
                self._problem(
                    sub, key_node, f"duplicate key {_show(key)} (first on line {self.lines[sub]})"
                )
                continue
            self.lines[sub] = key_node.start_mark.line + 1
            out[key] = self.value(value_node, sub, depth + 1)
        return out

    def _key(self, node: Node, path: str) -> str | None:
        self._visits += 1
        if node.tag == _TAG + "merge":
            self._problem(path, node, "YAML merge keys (<<) are not supported; use defaults:")
            return None
        if not isinstance(node, ScalarNode) or node.tag not in _SCALAR_TAGS:
            self._problem(path, node, "mapping keys must be plain strings")
            return None
        key = self._scalar(node, path)
        if not isinstance(key, str):
            self._problem(
                path, node, f"mapping keys must be strings, got {_describe(key)} (quote it)"
            )
            return None
        return key


def _tag_name(tag: str) -> str:
    return "!!" + tag[len(_TAG) :] if tag.startswith(_TAG) else _show(tag)


def _join(path: str, key: str) -> str:
    if len(key) > 64 or not key.isprintable():
        key = repr(key[:64])  # keeps each problem on one short line
    return f"{path}.{key}" if path else key


def _line_for(lines: Mapping[str, int], path: str) -> int | None:
    """The line of `path`, else of the nearest enclosing key or item that has one."""
    while path not in lines and path:
        cut = max(path.rfind("."), path.rfind("["))
        path = path[:cut] if cut > 0 else ""
    return lines.get(path)


def _describe(value: object) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
    }
    kind = kinds.get(type(value), type(value).__name__)
    return kind if isinstance(value, (list, dict)) or value is None else f"{kind} {_show(value)}"


def _show(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        text = repr(value)
    except ValueError:  # int -> str refuses more than 4300 digits
        text = "<integer too large to print>"
    if len(text) <= 60:
        return text
    return text[:56] + ("...'" if text[0] in "'\"" else "...")
