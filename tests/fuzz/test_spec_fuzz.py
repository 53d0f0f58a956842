"""Spec fuzzing: `engined --check` on mutated fleet specs exits 0 or 78, never with a traceback,
and every problem it reports names a key path or a YAML line.

Structure-aware mutations start from valid specs (the shipped fleet files and a spec that sets every
key) and drop, rename, duplicate or replace keys, put wrong types and huge numbers in, share
subtrees as YAML anchors/aliases (recursive ones too), nest values deeply; text-level mutations
then truncate the YAML, splice in YAML oddities (tags, merge keys, undefined aliases, directives,
documents) or bytes that are not UTF-8; and some cases are random bytes. Most cases run
`supervisor.daemon.main(["-c", FILE, "--check"])` in-process; a sample runs the real `engined`
executable as a subprocess and must print exactly what the in-process run printed.

tests/unit/test_spec.py already fuzzes `parse_fleet` with unstructured text; this file drives the
daemon's own entry point with inputs close enough to valid to reach the deep checks.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engined.supervisor import daemon
from engined.supervisor.spec import SpecError, load_fleet
from testkit.driver import PYTHON, REPO_ROOT, _clean_env

IN_PROCESS_STRUCTURED = 300
IN_PROCESS_TEXT = 150
IN_PROCESS_BYTES = 60
SUBPROCESS_CASES = 30  # each starts an interpreter (~0.2 s)
FUZZ = settings(deadline=None, derandomize=False, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

HEADER = "engined: invalid fleet spec:"
# Problems about the file as a whole, where neither a key nor a line would mean anything.
WHOLE_FILE = ("fleet spec is empty", "fleet spec is too large", "cannot read fleet spec")
MORE_PROBLEMS = re.compile(r"\.\.\. and \d+ more problems$")


def only_warnings(err: str) -> bool:
    """A valid spec's --check may warn (a model directory absent on this machine), nothing else."""
    return all(line.startswith("engined: warning: ") for line in err.splitlines())


# --- valid starting points ----------------------------------------------------------------------

EVERY_KEY = {
    "version": 1,
    "supervisor": {"http": "127.0.0.1:9400", "control_socket": "/run/engined/ctl.sock",
                   "runtime_dir": "/run/engined", "log_dir": "/var/log/engined",
                   "heartbeat_interval": "500ms", "heartbeat_timeout": "5s",
                   "launcher": "exec", "log_max_bytes": "20MiB", "log_backups": 5},
    "defaults": {"restart": "on-failure",
                 "backoff": {"initial": "2s", "max": "1m", "factor": 3, "jitter": 0.2,
                             "reset_after": "5m"},
                 "start_limit": {"burst": 3, "interval": "60s"},
                 "startup_timeout": "20m", "stall_timeout": "90s", "stop_timeout": "10s",
                 "threads": 2, "env": {"SHARED": "1"}},
    "engines": [
        {"name": "tiny", "replicas": 2, "model": {"path": "/models/llama", "dtype": "bfloat16"},
         "gpus": [3, 1, 0, 2], "gpus_per_replica": 2, "data_parallel": True,
         "max_batch_size": 16, "backoff": {"initial": "500ms"}, "start_limit": {"burst": 10},
         "env": {"HF_HOME": "/cache", "LEVEL": 3}},
        {"name": "echo", "replicas": 3, "model": "builtin:echo", "restart": "never",
         "threads": 1, "stall_timeout": 5, "env": {"ENGINED_ECHO_TOKEN_MS": "5"},
         "served_model_name": "echo-model", "queue_limit": 64, "request_timeout": "2m",
         "migration_limit": 2, "rollout": {"max_unavailable": 2, "max_surge": 1},
         "standby": 1},
        {"name": "llm", "model": "builtin:tiny-llama", "backend": "vllm",
         "engine_args": {"max_model_len": 1024, "enforce_eager": True},
         "launcher": "forkserver"},
        {"name": "served", "replicas": 2, "command": [PYTHON, "-m", "server", "--port", "{port}"],
         "port": 18000, "cwd": "/", "probe": {"path": "/health", "interval": "1s",
                                              "timeout": "500ms", "failures": 2},
         "progress": {"metrics": "/metrics", "busy": "x:running", "counter": "x:tokens"},
         "openai": "vllm"},
    ],
}
EVERY_KEY["supervisor"]["gateway"] = "127.0.0.1:8000"


def _shipped_specs() -> list[dict[str, Any]]:
    files = [REPO_ROOT / "etc" / "fleet.yaml",
             *sorted((REPO_ROOT / "etc" / "examples").glob("*fleet*.yaml"))]
    return [yaml.safe_load(f.read_text()) for f in files]


BASES = [EVERY_KEY, *_shipped_specs()]


@pytest.mark.smoke
def test_starting_points_are_valid(tmp_path: Path) -> None:
    """Mutations must start from specs that pass, or the fuzzing only ever tests rejection."""
    for i, base in enumerate(BASES):
        path = tmp_path / f"base{i}.yaml"
        path.write_text(yaml.safe_dump(base, sort_keys=False))
        code, out, err = check_in_process(path)
        assert code == 0, err
        assert out.startswith("fleet ") and only_warnings(err), err


# --- rendering with duplicates -------------------------------------------------------------------


class Pairs(list):
    """A mapping rendered from (key, value) pairs, so a key can appear twice."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Pairs, lambda dumper, pairs: dumper.represent_mapping(
    "tag:yaml.org,2002:map", list(pairs)))


def render(tree: Any, flow: bool) -> bytes:
    text = yaml.dump(tree, Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                     default_flow_style=flow, width=10_000)
    return text.encode("utf-8", "surrogatepass")


# --- structure-aware mutations --------------------------------------------------------------------


def _paths(tree: Any, prefix: tuple = (), open_: frozenset[int] = frozenset()) -> Iterator[tuple]:
    """Every position in the tree: mapping keys and list indexes (a recursive node once)."""
    yield prefix
    if isinstance(tree, Pairs) or id(tree) in open_:
        return  # Pairs: its keys may repeat, not addressable; or we are inside it already
    inside = open_ | {id(tree)}
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,), inside)
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, prefix + (i,), inside)


def _parent(tree: Any, path: tuple) -> Any:
    for step in path[:-1]:
        tree = tree[step]
    return tree


HUGE = st.sampled_from([10**400, -(10**400), 2**63, 2**64 + 1, -1, 0, 10**18, 1e308, 1e-320,
                        float("inf"), float("-inf"), float("nan"), 1e999])
DURATION_TEXT = st.from_regex(r"-?[0-9]{0,12}(\.[0-9]{0,4})?(e[0-9]{1,3})? ?(ms|s|m|h|d|us)?",
                              fullmatch=True)
WEIRD_TEXT = st.sampled_from(["", " ", "all", "builtin:", "builtin:nope", "127.0.0.1:99999",
                              "[::1]:80", "off", "on", "yes", "no", "null", "~", "NaN", ".inf",
                              "0x1f", "1_000", "0o17", "a" * 300, "\t", "é", "\u202e", "\x85",
                              "ENGINED_X", "CUDA_VISIBLE_DEVICES", "../../etc", "tiny-0"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), HUGE,
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    WEIRD_TEXT, DURATION_TEXT)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.lists(inner, max_size=4),
                     st.dictionaries(st.one_of(st.text(max_size=8), WEIRD_TEXT), inner,
                                     max_size=4))


VALUES = st.recursive(SCALARS, _containers, max_leaves=12)
KNOWN_KEYS = ["version", "supervisor", "defaults", "engines", "name", "replicas", "model", "path",
              "dtype", "gpus", "gpus_per_replica", "data_parallel", "max_batch_size", "threads",
              "env", "restart", "backoff", "initial", "max", "factor", "jitter", "reset_after",
              "start_limit", "burst", "interval", "startup_timeout", "stall_timeout",
              "stop_timeout", "http", "control_socket", "runtime_dir", "log_dir",
              "heartbeat_interval", "heartbeat_timeout", "replica", "Name", "gpu", "<<",
              "gateway", "api_key_file", "backend", "engine_args", "served_model_name",
              "queue_limit", "request_timeout", "migration_limit", "rollout", "max_unavailable",
              "max_surge", "python", "command", "port", "cwd", "probe", "progress", "openai",
              "timeout", "failures", "metrics", "busy", "counter"]
KEYS = (st.sampled_from(KNOWN_KEYS) | st.text(max_size=10) | st.integers() | st.booleans()
        | st.none())
OPS = ["drop", "replace", "replace", "rename", "add", "duplicate", "alias", "recursive", "nest",
       "wrong_container", "swap"]


def _mutate(draw: st.DrawFn, tree: Any) -> Any:
    paths = list(_paths(tree))
    path = draw(st.sampled_from(paths), label="path")
    op = draw(st.sampled_from(OPS), label="op")
    if not path:  # the root itself
        return draw(VALUES, label="root") if op in ("replace", "wrong_container") else tree
    parent, last = _parent(tree, path), path[-1]
    value = parent[last]
    if isinstance(value, Pairs) and op in ("add", "recursive", "wrong_container", "nest"):
        return tree  # a mapping with a duplicate key stays as it is
    if op == "drop":
        del parent[last]
    elif op == "replace":
        parent[last] = draw(VALUES, label="value")
    elif op == "rename" and isinstance(parent, dict):
        parent[draw(KEYS, label="new key")] = parent.pop(last)
    elif op == "add" and isinstance(value, dict):
        value[draw(KEYS, label="key")] = draw(VALUES, label="value")
    elif op == "duplicate" and isinstance(parent, dict):
        pairs = Pairs(parent.items())
        pairs.append((last, draw(st.just(copy.deepcopy(value)) | VALUES, label="dup")))
        if len(path) == 1:
            return pairs
        _parent(tree, path[:-1])[path[-2]] = pairs
    elif op == "alias":
        # Share this subtree somewhere else: the dumper writes &anchor / *alias.
        target = draw(st.sampled_from(paths), label="alias target")
        if target and target[:len(path)] != path:
            _parent(tree, target)[target[-1]] = value
    elif op == "recursive" and isinstance(value, (dict, list)):
        if isinstance(value, dict):
            value["self"] = value
        else:
            value.append(value)
    elif op == "nest":
        depth = draw(st.integers(1, 200), label="depth")
        for _ in range(depth):
            value = [value] if draw(st.booleans(), label="list") else {"k": value}
        parent[last] = value
    elif op == "wrong_container":
        parent[last] = [value] if not isinstance(value, list) else {"0": value}
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        parent.append(parent[0])
    return tree


@st.composite
def structured_specs(draw: st.DrawFn) -> bytes:
    tree = copy.deepcopy(draw(st.sampled_from(BASES), label="base"))
    for _ in range(draw(st.integers(1, 4), label="mutations")):
        if isinstance(tree, (dict, list)):
            tree = _mutate(draw, tree)
    if isinstance(tree, dict) and not isinstance(tree, Pairs) and draw(st.booleans()):
        tree = dict(reversed(list(tree.items())))  # key order must not matter
    try:
        return render(tree, flow=draw(st.booleans(), label="flow style"))
    except (yaml.YAMLError, RecursionError, ValueError) as exc:  # unrepresentable: say so
        return f"# could not render: {type(exc).__name__}\nversion: 1\n".encode()


ODDITIES = [b"&a ", b"*a", b"*undefined_alias", b"!!python/object/apply:os.system ['true']",
            b"!!binary aGVsbG8=", b"!!timestamp 2001-12-14", b"!!set {a, b}", b"!!omap [a: 1]",
            b"!custom x", b"<<: *a", b"? [complex, key]\n: v", b"%YAML 1.1\n---\n", b"---\n",
            b"...\n", b"\t", b"\r\n", b"\xef\xbb\xbf", b"\x00", b"\xff\xfe", b"\xc3\x28",
            b"\xed\xa0\x80", b"\\ud800", b'"\\ud800"', b"\x1b[31m", b"1.0e+999", b"9" * 5000,
            b"{", b"}", b"[", b"]", b"'", b'"', b": ", b"- ", b"#", b"|\n  block", b">-\n  fold",
            b"&x [*x]", b"key: &b {c: *b}", b"\x85", "\u2028".encode()]


@st.composite
def text_mutated_specs(draw: st.DrawFn) -> bytes:
    text = bytearray(draw(structured_specs()) if draw(st.booleans())
                     else render(copy.deepcopy(draw(st.sampled_from(BASES))), flow=False))
    for _ in range(draw(st.integers(1, 4), label="text edits")):
        at = draw(st.integers(0, len(text)), label="offset")
        kind = draw(st.sampled_from(["insert", "insert", "truncate", "delete", "bytes"]))
        if kind == "insert":
            text[at:at] = draw(st.sampled_from(ODDITIES), label="oddity")
        elif kind == "truncate":
            del text[at:]
        elif kind == "delete":
            del text[at:at + draw(st.integers(1, 20))]
        else:
            text[at:at] = draw(st.binary(min_size=1, max_size=8), label="bytes")
    return bytes(text)


RANDOM_BYTES = st.binary(max_size=2000) | st.text(max_size=500).map(
    lambda t: t.encode("utf-8", "surrogatepass"))
ANY_CASE = st.one_of(structured_specs(), text_mutated_specs(), RANDOM_BYTES)


# --- running engined --check and judging its answer ----------------------------------------------


def check_in_process(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = daemon.main(["-c", str(path), "--check"])
    return code, out.getvalue(), err.getvalue()


def check_subprocess(path: Path) -> tuple[int, str, str]:
    done = subprocess.run([PYTHON, "-m", "engined.supervisor.daemon", "-c", str(path), "--check"],
                          cwd=REPO_ROOT, env=_clean_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=60)
    return (done.returncode, done.stdout.decode("utf-8", "replace"),
            done.stderr.decode("utf-8", "replace"))


def judge(path: Path, code: int, out: str, err: str) -> None:
    """0 with the resolved fleet, or 78 with problems that each name a key path or a line."""
    assert code in (0, 78), (code, err[-2000:])
    assert "Traceback" not in err and "Traceback" not in out, err[-4000:]
    if code == 0:
        assert out.startswith(f"fleet {path}: ") and only_warnings(err), (out[:200], err)
        return
    assert out == "", out[:200]
    assert err.startswith(HEADER + "\n"), err[:500]
    try:
        load_fleet(path)
    except SpecError as exc:
        problems = exc.problems
    else:
        raise AssertionError("exit 78 but load_fleet accepts the spec")
    assert problems
    lines = err[len(HEADER) + 1:].rstrip("\n").split("\n")
    assert lines == [str(p) for p in problems], (lines, problems)
    for p in problems:
        assert p.file == str(path), p
        if p.path or p.line is not None:
            text = str(p)
            assert "\n" not in text
            continue
        assert p.message.startswith(WHOLE_FILE) or MORE_PROBLEMS.match(p.message), \
            f"a problem with neither key path nor line: {p}"


@pytest.fixture(scope="module")
def case_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="egfuzz") as tmp:
        yield Path(tmp)


def _run(case_dir: Path, data: bytes, subprocess_too: bool = False) -> str:
    """Judge one case; returns a short label of the outcome (for hypothesis statistics)."""
    path = case_dir / "fleet.yaml"
    path.write_bytes(data)
    code, out, err = check_in_process(path)
    judge(path, code, out, err)
    if subprocess_too:
        assert check_subprocess(path) == (code, out, err)
    return f"exit {code}" + (f": {err.splitlines()[1].split(': ')[1][:25]}" if code else "")


@pytest.mark.slow
@settings(FUZZ, max_examples=IN_PROCESS_STRUCTURED)
@given(structured_specs())
def test_structured_mutations(case_dir: Path, data: bytes) -> None:
    event(_run(case_dir, data))


@pytest.mark.smoke
@settings(FUZZ, max_examples=IN_PROCESS_TEXT)
@given(text_mutated_specs())
def test_text_mutations_and_yaml_oddities(case_dir: Path, data: bytes) -> None:
    event(_run(case_dir, data))


@pytest.mark.smoke
@settings(FUZZ, max_examples=IN_PROCESS_BYTES)
@given(RANDOM_BYTES)
def test_random_bytes(case_dir: Path, data: bytes) -> None:
    event(_run(case_dir, data))


@pytest.mark.slow
@settings(FUZZ, max_examples=SUBPROCESS_CASES)
@given(ANY_CASE)
def test_real_engined_check_matches(case_dir: Path, data: bytes) -> None:
    event(_run(case_dir, data, subprocess_too=True))


# A fixed corpus of the classic YAML traps, each through the real executable.
CORPUS = {
    "billion laughs": b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n".encode()
        for i in range(8)),
    "recursive alias": b"version: 1\nengines: &e [*e]\n",
    "python tag": b"version: !!python/object/apply:os.system ['echo pwned']\n",
    "merge key": b"version: 1\nx: &x {name: a}\nengines: [{<<: *x, model: builtin:echo}]\n",
    "huge int": b"version: 1" + b"0" * 5000 + b"\n",
    "deep list": b"version: 1\nengines: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "deep map": b"version: 1\nengines:\n" + b"".join(b"  " * i + b"k:\n" for i in range(200)),
    "two documents": b"version: 1\n---\nversion: 1\n",
    "only comments": b"# nothing here\n",
    "empty": b"",
    "nul byte": b"version: 1\x00\n",
    "latin-1": b"version: 1\nengines: [{name: caf\xe9, model: builtin:echo}]\n",
    "lone surrogate escape": b'version: 1\nengines: [{name: "\\ud800", model: builtin:echo}]\n',
    "bom and crlf": b"\xef\xbb\xbfversion: 1\r\nengines:\r\n  - {name: a, model: builtin:echo}\r\n",
    "tab indent": b"version: 1\nengines:\n\t- name: a\n",
    "non-string key": b"version: 1\n1: 2\n[a]: b\nengines: [{name: a, model: builtin:echo}]\n",
    "duplicate engine key": b"version: 1\nengines:\n- name: a\n  name: b\n  model: builtin:echo\n",
    "set tag": b"version: 1\nengines: !!set {a}\n",
    "timestamp": b"version: 2001-12-14\nengines: [{name: a, model: builtin:echo}]\n",
    "binary": b"version: !!binary aGVsbG8=\n",
    "spec is a list": b"- version: 1\n",
    "spec is a scalar": b"42\n",
}


@pytest.mark.parametrize("data", list(CORPUS.values()), ids=list(CORPUS))
def test_yaml_traps_through_the_real_executable(case_dir: Path, data: bytes) -> None:
    _run(case_dir, data, subprocess_too=True)


def test_unreadable_and_special_files(tmp_path: Path) -> None:
    """A directory, a missing file, /dev/zero (unbounded) as the spec: 78 naming the file."""
    for target in (tmp_path, tmp_path / "missing.yaml", Path("/dev/zero")):
        code, out, err = check_subprocess(target)
        assert code == 78, (target, err)
        assert "Traceback" not in err and str(target) in err, err
