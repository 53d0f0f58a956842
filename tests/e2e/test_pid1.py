"""engined as a container's main process: PID 1 of a PID namespace of its own (`unshare --pid
--fork --mount-proc`, what a container runtime gives it). There every orphan of the namespace is
its child: twenty engine kills, each leaving the descendants the engine started (some in
sessions of their own), leave no zombie and no leftover behind; and SIGTERM (what the kubelet
sends) is a drain: /readyz answers 503 at once, the stream in flight finishes, the engines stop
and engined exits 0 within the pod's grace period.

Pids in engined's status are the namespace's own; the test maps them to this host's through
/proc/PID/status (NSpid) and kills only processes of that namespace. Skips where a PID namespace
cannot be made (no privilege for unshare)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from testkit.driver import BackgroundStream, Daemon, build_spec, free_port

pytestmark = pytest.mark.timeout(600)
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
KILLS = 20
GRACE_S = 60  # the manifests' terminationGracePeriodSeconds is sized the same way (kubernetes/)


def _unshare_or_skip() -> None:
    """Skip where a PID namespace cannot be made; under CI=true (.ci/run installs util-linux
    and runs as root) fail instead."""
    give_up = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if shutil.which("unshare") is None:
        give_up("no unshare command (util-linux)")
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        give_up(f"cannot make a PID namespace here: {probe.stderr.strip()}")


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _namespace(ns: str) -> dict[int, tuple[int, str]]:
    """The processes of PID namespace `ns` (its /proc/PID/ns/pid link): namespace pid ->
    (host pid, state letter)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                continue
            status = _status(int(entry))
        except OSError:
            continue  # gone meanwhile
        out[int(status["NSpid"].split()[-1])] = (int(entry), status["State"][0])
    return out


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_engined_as_pid_1_reaps_every_orphan_and_drains_on_sigterm(short_tmp: Path):
    _unshare_or_skip()
    http, gateway = free_port(), free_port()
    root = short_tmp / "pid1"
    root.mkdir()
    d = Daemon(root, build_spec(root, [{
        "name": "echo", "replicas": 2, "model": "builtin:echo",
        # each incarnation starts a sleeping child and one in a session of its own, never
        # stopped: the leftovers the reaper kills and, as PID 1, engined reaps
        "env": {"ENGINED_ECHO_SPAWN": "child,setsid", "ENGINED_ECHO_TOKEN_MS": "50"}}],
        {"http": f"127.0.0.1:{http}", "gateway": f"127.0.0.1:{gateway}",
         "heartbeat_interval": "0.2s", "heartbeat_timeout": "10s"},
        {"backoff": {"initial": "0s", "max": "0s", "jitter": 0, "reset_after": "0s"},
         "start_limit": {"burst": 100, "interval": "120s"}}))
    d.wrapper = UNSHARE
    try:
        d.start()
        children = open(f"/proc/{d.pid}/task/{d.pid}/children").read().split()
        assert len(children) == 1, children
        host = int(children[0])  # engined, as the namespace sees it: PID 1
        assert _status(host)["NSpid"].split()[-1] == "1", _status(host)
        ns = os.readlink(f"/proc/{host}/ns/pid")
        d.wait_all_ready(120)
        settled = d.wait_for(lambda: (p := _namespace(ns)) and len(p) >= 7 and p, 30,
                             "engined, its guard, fork server, 2 engines and their descendants")
        baseline = len(settled)

        for i in range(KILLS):
            name = f"echo-{i % 2}"
            pid = d.engine(name)["pid"]
            os.kill(_namespace(ns)[pid][0], signal.SIGKILL)  # its host pid
            d.wait_restarted(name, pid, 60)
        d.wait_all_ready(60)
        d.wait_for(lambda: not [p for p, (_, s) in _namespace(ns).items() if s == "Z"], 30,
                   "no zombie left in the namespace")
        d.wait_for(lambda: len(_namespace(ns)) <= baseline, 30,
                   f"no leftover: {baseline} processes in the namespace, as before the kills")
        restarts = sum(e["restarts"] for e in d.engines().values())
        assert restarts >= KILLS, d.engines()

        # SIGTERM, as the kubelet sends it, while a stream is in flight
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reader = BackgroundStream(client, "echo", "y" * 60, 60)
        assert reader.started.wait(60)
        assert _readyz(http) == 200
        sent = time.monotonic()
        os.kill(host, signal.SIGTERM)
        d.wait_for(lambda: _readyz(http) == 503, 5, "/readyz 503 once the drain begins",
                   interval_s=0.02)
        reader.join(60)
        assert reader.text() == "y" * 60  # the stream in flight finished
        assert d.wait_exit(GRACE_S) == 0  # unshare gives engined's own exit status
        print(f"SIGTERM -> exit in {time.monotonic() - sent:.2f}s, {KILLS} kills, "
              f"{baseline} processes in the namespace")
        assert not _namespace(ns)  # the namespace is gone with its PID 1
    finally:
        if d.alive():  # --kill-child: the whole namespace dies with unshare
            d.proc.kill()
            d.proc.wait(10)
        d.dump()
