"""The snapshot format (supervisor.snapshot): written atomically, read back whole, a sample of
format 1 (checked in) read by this release, fields a reader does not know ignored and named,
and nothing in the file (a newer format, bad JSON, wrong types, random bytes) ever raises."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from engined.supervisor.upgrade import snapshot

SAMPLE = Path(__file__).parent / "data" / "snapshot-format1.json"


def test_the_checked_in_format_1_sample_is_read_whole():
    found, why = snapshot.load(SAMPLE)
    assert why == "ok" and found is not None
    assert (found.format, found.pid, found.handovers, found.reloads) == (1, 4242, 2, 3)
    tiny, failed, backoff = found.replicas
    assert tiny.restarts == {"signal": 2, "hang": 1} and tiny.requests["ok"] == 120
    assert tiny.process is not None and tiny.process.address == ("tiny-0", 4)
    assert tiny.process.ready is not None and tiny.process.ready["device"] == "cpu"
    assert failed.state == "FAILED" and failed.fail_reason == "5 failures in 120s"
    assert backoff.restart_in_s == 1.5 and backoff.restart_reason == "exit"
    assert found.counters.gateway_requests[0] == ("tiny", "ok", 118)
    assert found.fds is not None and found.fds.connections == {"gateway": [20, 21]}


def test_written_atomically_read_back_equal(tmp_path: Path):
    original, _ = snapshot.load(SAMPLE)
    assert original is not None
    path = snapshot.path_in(tmp_path)
    snapshot.write(path, original)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == [snapshot.FILE_NAME]  # no temporary file left behind
    again, why = snapshot.load(path)
    assert why == "ok" and again == original
    snapshot.write(path, msgspec.structs.replace(original, handovers=3))  # replaced whole
    assert snapshot.load(path)[0].handovers == 3  # type: ignore[union-attr]


def test_fields_this_reader_does_not_know_are_ignored_and_named(tmp_path: Path, caplog):
    raw = json.loads(SAMPLE.read_text())
    raw["later"] = {"x": 1}
    raw["replicas"][0]["gpu_shares"] = [1, 2]
    raw["replicas"][0]["process"]["cgroup"] = "/x"
    raw["fds"]["pidfds"] = [3]
    path = tmp_path / "state.json"
    path.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="engined"):
        found, why = snapshot.load(path)
    assert why == "ok" and found is not None and found.replicas[0].name == "tiny-0"
    text = caplog.text
    for name in ("later", "replicas[0].gpu_shares", "replicas[0].process.cgroup",
                 "fds.pidfds"):
        assert name in text, text


def test_what_cannot_be_used_says_why_and_never_raises(tmp_path: Path):
    path = tmp_path / "state.json"
    assert snapshot.load(path) == (None, "none")
    raw = json.loads(SAMPLE.read_text())
    cases = {
        b"{not json": "not JSON",
        b"[1, 2]": "expected an object",
        json.dumps({**raw, "format": 2}).encode(): "newer than this engined's",
        json.dumps({**raw, "format": True}).encode(): "'format': expected an integer",
        json.dumps({**raw, "format": 0}).encode(): "does not exist",
        json.dumps({k: v for k, v in raw.items() if k != "format"}).encode(): "'format'",
        json.dumps({**raw, "replicas": [{"state": "READY"}]}).encode(): "name",
        json.dumps({**raw, "pid": "x"}).encode(): "$.pid",
    }
    for data, expected in cases.items():
        path.write_bytes(data)
        found, why = snapshot.load(path)
        assert found is None and expected in why, (data[:60], why)
    path.chmod(0)
    if os.geteuid() != 0:  # root reads anyway
        assert snapshot.load(path)[1].startswith("cannot read")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_the_reader_never_raises(tmp_path_factory, data):
    """Random JSON, the sample with a value replaced by random JSON, or random bytes."""
    raw = json.loads(SAMPLE.read_text())
    kind = data.draw(st.sampled_from(["value", "mutated", "bytes"]))
    if kind == "bytes":
        blob = data.draw(st.binary(max_size=200))
    elif kind == "value":
        blob = json.dumps(data.draw(JSON)).encode()
    else:
        node, keys = raw, []
        while isinstance(node, (dict, list)) and node:
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                            else range(len(node))))
            keys.append(key)
            if data.draw(st.booleans()):
                break
            node = node[key]
        target = raw
        for key in keys[:-1]:
            target = target[key]
        if keys:
            target[keys[-1]] = data.draw(JSON)
        blob = json.dumps(raw).encode()
    path = tmp_path_factory.mktemp("fuzz") / "state.json"
    path.write_bytes(blob)
    found, why = snapshot.load(path)
    assert (found is None) != (why == "ok"), why
    if found is not None:
        snapshot.dump(found)  # what was read can be written again


def test_start_ticks_names_a_process_once():
    mine = snapshot.start_ticks(os.getpid())
    assert isinstance(mine, int) and mine > 0
    assert snapshot.start_ticks(os.getpid()) == mine
    assert snapshot.start_ticks(2 ** 22 + 12345) is None  # beyond pid_max
