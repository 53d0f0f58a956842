"""Access to the control socket: only root and the daemon's own uid.

Two layers: the file system (the socket is 0600 inside a 0700 runtime directory, so another uid
cannot even reach it) and the daemon's own SO_PEERCRED check (for a socket placed where others can
reach it, e.g. a `supervisor.control_socket` in a shared directory with looser modes). A client
running as another uid is refused by both, and `enginectl` exits 4 saying access was denied.

The other uid is 65534 (nobody). The client drops privileges itself in a helper interpreter: it
imports enginectl as root (the interpreter's files may be unreadable to nobody), then calls
setgroups/setgid/setuid and runs `enginectl` in-process. Tests run as root; elsewhere they skip.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from testkit.driver import (
    ORPHAN_GRACE_S,
    REPO_ROOT,
    Daemon,
    _clean_env,
    build_spec,
    wait_engines_gone,
)

OTHER_UID = 65534

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")

# Runs `enginectl ARGS...` as OTHER_UID; or, with "--raw", one raw HTTP GET as OTHER_UID and
# prints the status line (to see the daemon's own 403, without enginectl in the way).
_AS_OTHER_UID = f"""
import os, socket, sys
import argparse, gettext, http.client, json, shutil, textwrap  # noqa: F401
import engined.supervisor.ctl.cli
# Everything is imported before dropping privileges: the interpreter's stdlib may live under a
# directory the other uid cannot read (e.g. /root/.pyenv).
os.setgroups([])
os.setgid({OTHER_UID})
os.setuid({OTHER_UID})
assert os.getuid() == {OTHER_UID} and os.geteuid() == {OTHER_UID}
if sys.argv[1] == "--raw":
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[2])
    s.sendall(b"GET /v1/status HTTP/1.1\\r\\nHost: engined\\r\\nConnection: close\\r\\n\\r\\n")
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    print(reply.decode("latin-1"))
    sys.exit(0)
sys.exit(engined.supervisor.ctl.cli.main(sys.argv[1:]))
"""


def as_other_uid(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _AS_OTHER_UID, *args], cwd=REPO_ROOT,
                          env=_clean_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.smoke
def test_socket_is_0600_in_a_0700_runtime_dir_and_other_uids_cannot_reach_it(engined):
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo"}])
    sock_mode = os.stat(d.socket).st_mode
    assert stat.S_ISSOCK(sock_mode)
    assert stat.S_IMODE(sock_mode) == 0o600, oct(sock_mode)
    assert stat.S_IMODE(os.stat(d.runtime_dir).st_mode) == 0o700
    assert os.stat(d.runtime_dir).st_uid == os.getuid() == os.stat(d.socket).st_uid
    before = d.engines()

    out = as_other_uid("--socket", d.socket, "status")
    assert out.returncode == 4, out
    err = out.stderr.strip()
    # The file system refused (the runtime directory is 0700): the message says so, names the
    # socket and who may use it, and does not blame a daemon that never saw the client.
    assert err.startswith(f"enginectl: access denied to engined's socket {d.socket}: "
                          "Permission denied"), err
    assert f"you are uid {OTHER_UID}" in err, err
    assert "Traceback" not in out.stderr
    for command in (["restart", "all"], ["stop", "echo-0"], ["generate", "x"], ["reload"],
                    ["logs", "echo-0"]):
        out = as_other_uid("--socket", d.socket, *command)
        assert out.returncode == 4 and "access denied" in out.stderr, (command, out)

    after = d.engines()
    assert {n: (e["pid"], e["incarnation"]) for n, e in after.items()} == \
        {n: (e["pid"], e["incarnation"]) for n, e in before.items()}


def test_peer_credentials_are_checked_when_the_socket_is_reachable(short_tmp):
    """The daemon's own check: the socket moved to a shared 0755 directory and opened up to 0666
    (as a careless operator might), another uid connects fine and is refused with 403."""
    os.chmod(short_tmp, 0o755)  # mkdtemp's 0700 would stop nobody before the socket does
    shared = short_tmp / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    path = str(shared / "ctl.sock")
    root = short_tmp / "d"
    root.mkdir()
    d = Daemon(root, build_spec(root, [{"name": "echo", "replicas": 1, "model": "builtin:echo"}],
                                {"control_socket": path}, None))
    d.socket = path  # the driver talks to the configured socket
    try:
        d.start()
        d.wait_all_ready()
        _check_peer_credentials(d, path)
    finally:
        d.spawned_pids()
        code = d.stop()
        left = wait_engines_gone(d.spawned_pids(), d.pid, ORPHAN_GRACE_S)
        d.dump()
    assert code == 0 and not left, (code, left)


def _check_peer_credentials(d: Daemon, path: str) -> None:
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # the daemon's default, wherever it is
    os.chmod(path, 0o666)
    before = d.engines()

    raw = as_other_uid("--raw", path)
    assert raw.returncode == 0, raw
    head, _, body = raw.stdout.partition("\n\n")  # text mode: CRLF arrives as LF
    assert head.startswith("HTTP/1.1 403 "), raw.stdout
    assert json.loads(body) == {"error": f"access denied for uid {OTHER_UID}"}, body

    out = as_other_uid("--socket", path, "status")
    assert out.returncode == 4, out
    assert out.stderr.strip() == (f"enginectl: access denied by engined at {path}: "
                                  f"access denied for uid {OTHER_UID}"), out.stderr
    for command in (["restart", "all"], ["stop", "all"], ["generate", "x"], ["reload"],
                    ["logs", "echo-0", "-n", "5"]):
        out = as_other_uid("--socket", path, *command)
        assert out.returncode == 4, (command, out)
        assert f"access denied for uid {OTHER_UID}" in out.stderr, (command, out)

    # Nothing was done on their behalf; the owner (root) is still served on the same socket.
    after = d.engines()
    assert {n: (e["pid"], e["incarnation"], e["state"]) for n, e in after.items()} == \
        {n: (e["pid"], e["incarnation"], e["state"]) for n, e in before.items()}
    assert d.ctl("status").returncode == 0
    assert "[control] refused uid 65534" in d.stderr_text()


def test_a_new_daemon_tightens_a_loosened_runtime_dir_again(engined):
    """Someone loosened the runtime directory while the daemon was down: the next start puts it
    back to 0700, and the new socket is 0600 again."""
    d = engined([{"name": "echo", "replicas": 1, "model": "builtin:echo"}])
    assert d.stop() == 0
    os.chmod(d.runtime_dir, 0o755)
    if os.path.exists(d.socket):  # a clean stop removes it; a stale one must not keep 0666
        os.chmod(d.socket, 0o666)
    d.start()
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d.runtime_dir).st_mode) == 0o700
    out = as_other_uid("--socket", d.socket, "status")
    assert out.returncode == 4 and "access denied" in out.stderr, out
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(d.socket)  # root may always connect
