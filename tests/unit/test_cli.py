"""enginectl against a real aiohttp server on a unix socket serving canned control-API answers."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engined.engine import contract
from engined.supervisor.ctl import cli, commands, nodes
from engined.supervisor.ctl import format as ctlformat

REPO_ROOT = Path(__file__).resolve().parents[2]
NOW = time.time()
Cap = pytest.CaptureFixture[str]
Server = tuple[str, "FakeDaemon"]  # (socket path, the fake daemon behind it)

STATUS: dict[str, Any] = {
    "supervisor": {"pid": 1, "version": "0.1.0", "uptime_s": 12.0,
                   "config": "/etc/engined/fleet.yaml", "generation": 1},
    "engines": [
        {"name": "tiny-0", "group": "tiny", "state": "READY", "pid": 1234, "incarnation": 1,
         "restarts": 0, "since": NOW - 192, "startup_s": 3.1, "heartbeat_age_s": 0.4,
         "last_exit": None, "gpus": [], "rss_bytes": 1, "gpu_memory": [], "desired": "run",
         "rank": None},
        {"name": "tiny-1", "group": "tiny", "state": "BACKOFF", "pid": None, "incarnation": 3,
         "restarts": 2, "since": NOW - 5, "startup_s": None, "heartbeat_age_s": None,
         "last_exit": {"code": None, "signal": "SIGKILL", "reason": "signal", "at": NOW - 130,
                       "log_tail": ["loading model", "Killed"]},
         "gpus": [], "rss_bytes": 0, "gpu_memory": [], "desired": "run", "rank": None},
        {"name": "echo-0", "group": "echo", "state": "STOPPED", "pid": None, "incarnation": 1,
         "restarts": 0, "since": NOW - 60, "startup_s": None, "heartbeat_age_s": None,
         "last_exit": {"code": 78, "signal": None, "reason": "exit", "at": None, "log_tail": []},
         "gpus": [], "rss_bytes": 0, "gpu_memory": [], "desired": "stopped", "rank": None},
    ],
}

RELOAD = {"added": ["big"], "removed": [], "changed": ["tiny"], "unchanged": ["echo"],
          "restart_required": ["tiny"]}


@pytest.fixture(autouse=True)
def _pinned_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ages in the table are computed against NOW, however long the suite has run."""
    for module in (commands, nodes):
        monkeypatch.setattr(module, "wall_now", lambda: NOW)


class FakeDaemon:
    """Canned control API; tests tweak `status`, `forbid` and read `requests`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.status: dict[str, Any] = copy.deepcopy(STATUS)
        self.forbid = False
        self.reload_error: str | None = None
        self.requests: list[tuple[str, str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard])
        app.router.add_get("/v1/status", self.get_status)
        app.router.add_post("/v1/engines/{name}/{action}", self.action)
        app.router.add_post("/v1/reload", self.reload)
        app.router.add_get("/v1/engines/{name}/logs", self.logs)
        app.router.add_post("/v1/generate", self.generate)
        return app

    @web.middleware
    async def guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path_qs, body))
        if self.forbid:
            return web.json_response({"error": "uid 1000 is not allowed"}, status=403)
        return await handler(request)

    async def get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status)

    async def action(self, request: web.Request) -> web.Response:
        name, action = request.match_info["name"], request.match_info["action"]
        state = "STOPPED" if action == "stop" else "READY"
        replicas = {"tiny-0": ["tiny-0"], "tiny": ["tiny-0", "tiny-1"], "broken": ["broken-0"]}
        if name not in replicas:
            return web.json_response({"error": f"unknown engine '{name}'"}, status=404)
        results = [{"name": n, "state": "FAILED" if name == "broken" else state,
                    "pid": None if state == "STOPPED" or name == "broken" else 1000 + i,
                    "ok": name != "broken",
                    "error": "exit code 78 (config)" if name == "broken" else None}
                   for i, n in enumerate(replicas[name])]
        return web.json_response({"engines": results})

    async def reload(self, request: web.Request) -> web.Response:
        if self.reload_error:
            return web.json_response({"error": self.reload_error}, status=400)
        return web.json_response(RELOAD)

    async def logs(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in ("tiny-0", "tiny-1"):
            return web.json_response({"error": f"unknown engine '{name}'"}, status=404)
        n = int(request.query["lines"])
        if request.query.get("follow") != "1":
            return web.Response(text="".join(f"old {i}\n" for i in range(n)))
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if name == "tiny-1":  # one line, then stay open until the client goes away
            await resp.write(b"first\n")
            deadline = time.monotonic() + 10
            while not request.transport.is_closing() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return resp
        for i in range(3):
            await resp.write(f"new {i}\n".encode())
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["engine"] == "nope":
            return web.json_response({"error": "unknown engine 'nope'"}, status=404)
        return web.json_response({"engine": body["engine"] or "tiny-0",
                                  "text": body["prompt"][::-1],
                                  "prompt_tokens": 3, "completion_tokens": body["max_tokens"],
                                  "batch_size": 1, "queue_s": 0.0, "compute_s": 0.01,
                                  "total_s": 0.01})


class ServerThread:
    """An aiohttp unix-socket server on its own event loop in a daemon thread."""

    def __init__(self, path: str, daemon: FakeDaemon) -> None:
        self.path, self.daemon = path, daemon
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.daemon.app())
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.UnixSite(self.runner, self.path).start())
        self.ready.set()
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(5), "server did not start"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = str(tmp_path_factory.mktemp("ctl") / "control.sock")
    daemon = FakeDaemon()
    thread = ServerThread(path, daemon)
    thread.start()
    yield path, daemon
    thread.stop()


@pytest.fixture
def daemon(server: Server) -> FakeDaemon:
    """The fake daemon, reset to its defaults (the server is shared by the module)."""
    server[1].reset()
    return server[1]


@pytest.fixture
def sock(server: Server, daemon: FakeDaemon,
         monkeypatch: pytest.MonkeyPatch) -> str:
    """The server's socket, passed the way most users do: via $ENGINED_SOCKET."""
    monkeypatch.setenv("ENGINED_SOCKET", server[0])
    return server[0]


# --- status -----------------------------------------------------------------------------------


def test_status_table_lists_engines_and_exits_3_when_a_running_engine_is_not_ready(
        sock: str, capsys: Cap) -> None:
    assert cli.main(["status"]) == 3
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == commands.STATUS_HEADER
    assert lines[1].split()[:5] == ["tiny-0", "READY", "1234", "0", "3m12s"]
    assert "0.4s" in lines[1]
    assert "signal SIGKILL (signal) 2m ago" in lines[2]
    assert lines[3].split()[:2] == ["echo-0", "STOPPED"] and lines[3].endswith("code 78 (exit)")
    # Aligned: every row's STATE cell starts where the header's does.
    col = lines[0].index("STATE")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines)


def test_status_ignores_engines_stopped_on_purpose(
        daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    daemon.status["engines"][1]["state"] = "READY"
    assert cli.main(["status"]) == 0


def test_status_named_ready_engine_exits_0(sock: str) -> None:
    assert cli.main(["status", "tiny-0"]) == 0


def test_status_named_engine_not_ready_exits_3_and_shows_log_tail(
        sock: str, capsys: Cap) -> None:
    assert cli.main(["status", "tiny-1"]) == 3
    out = capsys.readouterr().out
    assert "tiny-1" in out and "tiny-0" not in out and "BACKOFF" in out
    assert "    loading model\n    Killed\n" in out


def test_status_named_stopped_engine_exits_3(sock: str) -> None:
    assert cli.main(["status", "echo-0"]) == 3


def test_status_group_name_selects_its_replicas(
        sock: str, capsys: Cap) -> None:
    assert cli.main(["status", "tiny"]) == 3
    out = capsys.readouterr().out
    assert "tiny-0" in out and "tiny-1" in out and "echo-0" not in out


def test_status_unknown_name_exits_1(sock: str, capsys: Cap) -> None:
    assert cli.main(["status", "ghost"]) == 1
    assert capsys.readouterr().err == "enginectl: unknown engine 'ghost'\n"


def test_status_json_is_the_api_json(sock: str, capsys: Cap) -> None:
    assert cli.main(["status", "--json"]) == 3
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(STATUS))


def test_status_json_with_names_keeps_only_those_engines(
        sock: str, capsys: Cap) -> None:
    assert cli.main(["status", "--json", "tiny-0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in data["engines"]] == ["tiny-0"]
    assert data["supervisor"] == STATUS["supervisor"]


# --- restart / stop / start -------------------------------------------------------------------


def test_restart_prints_one_line_per_engine_and_sends_wait_and_timeout(
        daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["restart", "tiny", "--timeout", "7"]) == 0
    assert capsys.readouterr().out == "tiny-0: READY (pid 1000)\ntiny-1: READY (pid 1001)\n"
    assert daemon.requests == [("POST", "/v1/engines/tiny/restart",
                                {"wait": True, "timeout_s": 7.0})]


def test_stop_no_wait(daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["stop", "tiny-0", "--no-wait"]) == 0
    # not "STOPPED" as if it were done, nor "READY (pid <old pid>)" after a restart: what was
    # asked, and the state the engine was in when it was asked
    assert capsys.readouterr().out == "tiny-0: stop requested (was STOPPED)\n"
    assert daemon.requests[0][2] == {"wait": False, "timeout_s": 120.0}


def test_start_ok_false_exits_1(sock: str, capsys: Cap) -> None:
    assert cli.main(["start", "broken"]) == 1
    assert capsys.readouterr().out == "broken-0: FAILED: exit code 78 (config)\n"


def test_restart_unknown_engine_exits_1_but_does_the_other_names(
        daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["restart", "ghost", "tiny-0"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "enginectl: unknown engine 'ghost'\n"
    assert captured.out == "tiny-0: READY (pid 1000)\n"
    assert [r[1] for r in daemon.requests] == ["/v1/engines/ghost/restart",
                                               "/v1/engines/tiny-0/restart"]


# --- reload / logs / generate -----------------------------------------------------------------


def test_reload_prints_the_diff(sock: str, capsys: Cap) -> None:
    assert cli.main(["reload"]) == 0
    assert capsys.readouterr().out == ("added: big\nchanged: tiny\nunchanged: echo\n"
                                       "restart required: tiny\n")


def test_reload_error_exits_1(daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    daemon.reload_error = "fleet.yaml: engines[1].gpus_per_replica: must be >= 0"
    assert cli.main(["reload"]) == 1
    assert capsys.readouterr().err == (
        "enginectl: fleet.yaml: engines[1].gpus_per_replica: must be >= 0\n")


def test_format_reload_without_changes() -> None:
    assert commands.format_reload({"added": [], "removed": [], "changed": [],
                              "unchanged": ["a", "b"], "restart_required": []}) == [
        "no changes", "unchanged: a, b"]


def test_logs_prints_last_lines(daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["logs", "tiny-0", "-n", "2"]) == 0
    assert capsys.readouterr().out == "old 0\nold 1\n"
    assert daemon.requests[0][1] == "/v1/engines/tiny-0/logs?lines=2"


def test_logs_default_line_count(daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["logs", "tiny-0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 50


def test_logs_follow_streams_until_the_server_closes(
        daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["logs", "tiny-0", "-f", "-n", "1"]) == 0
    assert capsys.readouterr().out == "new 0\nnew 1\nnew 2\n"
    assert daemon.requests[0][1] == "/v1/engines/tiny-0/logs?lines=1&follow=1"


def test_logs_follow_flushes_each_line_and_exits_0_on_ctrl_c(sock: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "engined.supervisor.ctl.cli", "logs", "tiny-1",
                             "-f"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # The daemon keeps the stream open, so this line can only arrive through a flush.
        # Deadlines, not budgets: a loaded 2-core CI box can take seconds to run a process.
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no output within 60 s"
        assert proc.stdout.readline() == b"first\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_logs_unknown_engine_exits_1(sock: str, capsys: Cap) -> None:
    assert cli.main(["logs", "ghost"]) == 1
    assert capsys.readouterr().err == "enginectl: unknown engine 'ghost'\n"


def test_generate_prints_text(daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    assert cli.main(["generate", "--max-tokens", "5", "abc"]) == 0
    assert capsys.readouterr().out == "cba\n"
    assert daemon.requests[0][2] == {"prompt": "abc", "max_tokens": 5, "engine": None,
                                     "temperature": 0.0, "timeout_s": 300.0}


def test_generate_json(sock: str, capsys: Cap) -> None:
    assert cli.main(["generate", "--json", "--engine", "tiny-1", "hi"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["engine"] == "tiny-1" and data["text"] == "ih" and data["completion_tokens"] == 64


def test_generate_error_exits_1(sock: str, capsys: Cap) -> None:
    assert cli.main(["generate", "--engine", "nope", "hi"]) == 1
    assert capsys.readouterr().err == "enginectl: unknown engine 'nope'\n"


# --- reachability, access, usage --------------------------------------------------------------


def test_missing_socket_exits_4(tmp_path: Path, capsys: Cap) -> None:
    path = str(tmp_path / "control.sock")
    assert cli.main(["--socket", path, "status"]) == 4
    err = capsys.readouterr().err
    assert err.startswith(f"enginectl: cannot reach engined at {path}: ")
    assert err.endswith("(is engined running?)\n")


def test_refused_socket_exits_4(tmp_path: Path, capsys: Cap) -> None:
    path = str(tmp_path / "control.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)  # bound but not listening: connect() is refused
        assert cli.main(["--socket", path, "restart", "all"]) == 4
    assert "cannot reach engined" in capsys.readouterr().err


def test_forbidden_exits_4(daemon: FakeDaemon, sock: str,
                           capsys: Cap) -> None:
    daemon.forbid = True
    assert cli.main(["status"]) == 4
    assert capsys.readouterr().err == (
        f"enginectl: access denied by engined at {sock}: uid 1000 is not allowed\n")


def test_forbidden_action_stops_at_the_first_name(
        daemon: FakeDaemon, sock: str, capsys: Cap) -> None:
    daemon.forbid = True
    assert cli.main(["restart", "tiny-0", "tiny-1"]) == 4
    assert len(daemon.requests) == 1


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["restart"], ["status", "--bogus"], ["logs"], ["logs", "x", "-n", "-3"],
    ["restart", "x", "--timeout", "abc"], ["generate"], ["generate", "--max-tokens", "0", "x"],
])
def test_usage_errors_exit_2(argv: list[str], capsys: Cap) -> None:
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_help_exits_0(capsys: Cap) -> None:
    assert cli.main(["--help"]) == 0
    assert "restart" in capsys.readouterr().out


# --- where the socket is ----------------------------------------------------------------------


def test_socket_option_after_subcommand_beats_env(
        server: Server, daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv("ENGINED_SOCKET", str(tmp_path / "nothing.sock"))
    assert cli.main(["status", "tiny-0", "--socket", server[0]]) == 0


def test_socket_option_before_subcommand_beats_env(
        server: Server, daemon: FakeDaemon, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv("ENGINED_SOCKET", str(tmp_path / "nothing.sock"))
    assert cli.main(["--socket", server[0], "status", "tiny-0"]) == 0


def test_env_socket_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: Cap) -> None:
    path = str(tmp_path / "env.sock")
    monkeypatch.setenv("ENGINED_SOCKET", path)
    assert cli.main(["status"]) == 4
    assert path in capsys.readouterr().err


def test_default_socket_is_used_without_option_or_env(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: Cap) -> None:
    monkeypatch.delenv("ENGINED_SOCKET", raising=False)
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    assert cli.main(["status"]) == 4
    assert str(tmp_path / "control.sock") in capsys.readouterr().err


@pytest.mark.parametrize("env, expected", [
    ({"RUNTIME_DIRECTORY": "/run/engined", "XDG_RUNTIME_DIR": "/run/user/1"}, "/run/engined"),
    ({"RUNTIME_DIRECTORY": "/run/engined:/run/other"}, "/run/engined"),
    ({"RUNTIME_DIRECTORY": "", "XDG_RUNTIME_DIR": "/run/user/1"}, "/run/user/1/engined"),
    ({}, f"/tmp/engined-{os.getuid()}"),
])
def test_default_runtime_dir(env: dict[str, str], expected: str) -> None:
    assert contract.default_runtime_dir(env) == expected
    assert contract.default_socket_path(env) == f"{expected}/control.sock"


def test_default_socket_path_reads_the_process_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/42")
    assert contract.default_socket_path() == "/run/user/42/engined/control.sock"


# --- formatting -------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, coarse, expected", [
    (0, False, "0s"), (59.9, False, "59s"), (192, False, "3m12s"), (3600 + 300, False, "1h05m"),
    (2 * 86400 + 7200, False, "2d02h"), (130, True, "2m"), (-5, False, "0s"), (7200, True, "2h"),
])
def test_humanize_duration(seconds: float, coarse: bool, expected: str) -> None:
    assert ctlformat.humanize_duration(seconds, coarse) == expected


@pytest.mark.parametrize("last_exit, expected", [
    (None, "-"),
    ({"code": None, "signal": "SIGKILL", "reason": "signal", "at": 1000.0},
     "signal SIGKILL (signal) 2m ago"),
    ({"code": 78, "signal": None, "reason": "exit", "at": None}, "code 78 (exit)"),
    ({"code": 143, "signal": None, "reason": "hang", "at": 1115.0}, "code 143 (hang) 5s ago"),
])
def test_format_last_exit(last_exit: dict[str, Any] | None, expected: str) -> None:
    assert ctlformat.format_last_exit(last_exit, now=1120.0) == expected


# --- start-up cost ----------------------------------------------------------------------------


def test_cli_imports_only_light_modules() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           "import engined.supervisor.ctl.cli"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:") and line.count("|") == 2}
    assert "engined.supervisor.ctl.cli" in modules
    heavy = {m for m in modules
             if m.split(".")[0] in {"aiohttp", "yaml", "zmq", "pydantic", "msgspec", "torch"}}
    assert not heavy


def test_runs_as_a_script(sock: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "engined.supervisor.ctl.cli", "status", "tiny-0"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "tiny-0" in proc.stdout


# --- what the state column says -----------------------------------------------------------------

T0 = 1_700_000_000.0


@pytest.mark.parametrize("engine, cell", [
    ({"state": "READY"}, "READY"),
    ({"state": "READY", "role": "standby"}, "READY (standby)"),
    ({"state": "STARTING", "phase": "weights", "since": T0 - 75}, "STARTING (weights, 1m15s)"),
    ({"state": "STARTING", "since": T0 - 2}, "STARTING (spawned, 2s)"),
    ({"state": "BACKOFF", "restart_at": T0 + 4.2}, "BACKOFF (retry in 5s)"),
    ({"state": "BACKOFF", "restart_at": None}, "BACKOFF (restarting now)"),
    ({"state": "FAILED", "fail_reason": "exit 78: no tokenizer files"},
     "FAILED (exit 78: no tokenizer files)"),
    ({"state": "FAILED", "fail_reason": "start limit: " + "x" * 100},
     "FAILED (start limit: " + "x" * 46 + "…)"),
    ({"state": "STOPPED", "desired": "stopped"}, "STOPPED (by an operator)"),
    ({"state": "STOPPED", "desired": "run", "last_exit": {"code": 0}},
     "STOPPED (exited; its restart policy keeps it down)"),
    ({"state": "STOPPED", "desired": "run"}, "STOPPED"),
])
def test_the_state_column_explains_itself(engine: dict, cell: str) -> None:
    assert ctlformat.state_cell(engine, T0) == cell


def test_version_is_not_a_usage_error(capsys: Cap) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"enginectl {cli.__version__}"
