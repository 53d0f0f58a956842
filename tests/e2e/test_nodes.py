"""enginectl across nodes: each engined serves its control API on TCP as well
(`supervisor.control_tcp`, never without its `control_token_file`'s bearer token, TLS with
`control_tls_cert`/`control_tls_key`), and `enginectl --host` (repeatable) merges `status` with
a NODE column, shows a node it cannot reach as such (exit 3), and addresses `restart` /
`stop` / `start` as NODE/NAME. Two real daemons on loopback, one of them over TLS with a
certificate made here by openssl, and a third address nobody listens on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from engined.supervisor.spec import SpecError, parse_fleet
from testkit.driver import PYTHON, free_port

pytestmark = pytest.mark.timeout(300)


def _enginectl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "engined.supervisor.ctl.cli", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def _certificate(where: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:  # .ci/run installs it: under CI=true, fail
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "no openssl command to make a certificate")
    cert, key = where / "tls.crt", where / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True,
                   timeout=60)
    return cert, key


@pytest.mark.smoke
def test_enginectl_across_nodes(engined, short_tmp: Path):
    token = short_tmp / "token"
    token.write_text("s3cret-token\n")
    cert, key = _certificate(short_tmp)
    a, b, gone = free_port(), free_port(), free_port()
    node_a = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo"}], supervisor={
        "control_tcp": f"127.0.0.1:{a}", "control_token_file": str(token)})
    node_b = engined([{"name": "echo", "model": "builtin:echo"}], supervisor={
        "control_tcp": f"127.0.0.1:{b}", "control_token_file": str(token),
        "control_tls_cert": str(cert), "control_tls_key": str(key)})
    hosts = ["--host", f"a=127.0.0.1:{a}", "--host", f"b=https://127.0.0.1:{b}",
             "--token-file", str(token), "--cacert", str(cert)]

    done = _enginectl(*hosts, "status")
    assert done.returncode == 0, done
    rows = [line.split() for line in done.stdout.splitlines()]
    assert rows[0][:3] == ["NODE", "NAME", "STATE"], done.stdout
    assert sorted((r[0], r[1], r[2]) for r in rows[1:]) == [
        ("a", "echo-0", "READY"), ("a", "echo-1", "READY"), ("b", "echo-0", "READY")]

    # a node nobody answers for: shown, and exit 3, quickly
    started = time.monotonic()
    done = _enginectl(*hosts, "--host", f"c=127.0.0.1:{gone}", "status")
    print(f"status of 3 nodes, one down: {time.monotonic() - started:.2f}s (process included)")
    assert done.returncode == 3, done
    assert any(line.startswith("c ") and "UNREACHABLE" in line
               for line in done.stdout.splitlines()), done.stdout
    assert done.stdout.count("READY") >= 3, done.stdout

    # NODE/NAME: only that node's replica restarts
    pids = (node_a.engine("echo-0")["pid"], node_b.engine("echo-0")["pid"])
    done = _enginectl(*hosts, "restart", "a/echo-0")
    assert done.returncode == 0, done
    assert node_a.engine("echo-0")["pid"] != pids[0]
    assert node_b.engine("echo-0")["pid"] == pids[1]
    done = _enginectl(*hosts, "restart", "echo-0")
    assert done.returncode == 2 and "NODE/NAME" in done.stderr, done

    # events: every node's, each with its node, in time order; -f: then as they come
    done = _enginectl(*hosts, "events", "-n", "50", timeout_s=30)
    assert done.returncode == 0, done
    events = [json.loads(line) for line in done.stdout.splitlines()]
    assert {e["node"] for e in events} == {"a", "b"}
    assert [e["at"] for e in events] == sorted(e["at"] for e in events)
    assert any(e["node"] == "a" and e["engine"] == "echo-0" and e["to"] == "STOPPING"
               for e in events), events
    follow = subprocess.Popen([PYTHON, "-m", "engined.supervisor.ctl.cli", *hosts, "events", "-n",
                               "1", "-f"], stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(follow.stdout.readline())["node"] == "a"  # the last, of any node
        assert _enginectl(*hosts, "restart", "b/echo-0").returncode == 0
        came = [json.loads(follow.stdout.readline()) for _ in range(3)]
        assert [(e["node"], e["engine"], e["to"]) for e in came] == [
            ("b", "echo-0", "STOPPING"), ("b", "echo-0", "STARTING"), ("b", "echo-0", "READY")]
    finally:
        follow.kill()
        follow.wait(10)

    # one --host: every command, over TCP
    done = _enginectl("--host", f"127.0.0.1:{a}", "--token-file", str(token), "generate",
                      "--engine", "echo-1", "hello")
    assert (done.returncode, done.stdout.strip()) == (0, "hello"), done

    # never without the token, and TLS is checked
    wrong = short_tmp / "wrong"
    wrong.write_text("nope\n")
    done = _enginectl("--host", f"127.0.0.1:{a}", "--token-file", str(wrong), "status")
    assert done.returncode == 4 and "bearer token is required" in done.stderr, done
    done = _enginectl("--host", f"https://127.0.0.1:{b}", "--token-file", str(token), "status")
    assert done.returncode == 4 and "CERTIFICATE_VERIFY_FAILED" in done.stderr, done
    done = _enginectl("--host", f"127.0.0.1:{a}", "status")
    assert done.returncode == 2 and "--token-file" in done.stderr, done


def test_the_control_api_is_never_on_tcp_without_a_token():
    base = "version: 1\nsupervisor:\n  control_tcp: 127.0.0.1:9500\n{extra}" \
           "engines:\n  - name: a\n    model: builtin:echo\n"
    with pytest.raises(SpecError) as info:
        parse_fleet(base.format(extra=""), "fleet.yaml")
    assert "control_tcp needs control_token_file" in str(info.value)
    with pytest.raises(SpecError) as info:
        parse_fleet(base.format(extra="  control_token_file: /t\n  control_tls_cert: /c\n"),
                    "fleet.yaml")
    assert "control_tls_cert and control_tls_key go together" in str(info.value)
    assert parse_fleet(base.format(extra="  control_token_file: /t\n"),
                       "fleet.yaml").supervisor.control_tcp == ("127.0.0.1", 9500)
