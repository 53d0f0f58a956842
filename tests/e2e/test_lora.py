"""End to end: LoRA adapters as a user serves them, through the real daemon and its gateway, on
builtin:echo (an adapter's answer is "[name] " + the prompt, so the text says which adapter
answered; engine/echo.py). The spec's adapter (`adapters:`, relative to the spec file) and one
loaded at run time (`POST /v1/load_lora_adapter`, vLLM's shapes) are listed by /v1/models with
their parent, answer on every replica (each replica's own port, supervisor.replica_ports), and
keep answering the same after a replica's SIGKILL, an `enginectl upgrade` and a crash adoption;
an unloaded one is gone (404); what cannot be loaded or unloaded is refused naming the field."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from testkit.driver import Daemon, free_port
from testkit.probes import free_port_range, http_text, spawned_tree

PROMPT = "select 1"


def _adapter(directory: Path) -> Path:
    """What makes a directory an adapter to builtin:echo: a LoRA's adapter_config.json."""
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return directory


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=30)


def _error(answer: tuple[int, str]) -> tuple[int, dict[str, Any]]:
    status, text = answer
    return status, json.loads(text)["error"]


def _text(port: int, model: str, prompt: str = PROMPT) -> str:
    done = _client(port).completions.create(model=model, prompt=prompt, max_tokens=100)
    return done.choices[0].text


def _models(port: int) -> dict[str, dict[str, Any]]:
    return {m.id: m.model_dump() for m in _client(port).models.list()}


def _pids(d: Daemon) -> dict[str, int]:
    """Each engine's pid, as `enginectl status --json` says."""
    done = d.ctl("status", "--json")
    assert done.returncode == 0, done
    return {e["name"]: e["pid"] for e in json.loads(done.stdout)["engines"]}


def _start(engined, root: Path, **supervisor: Any) -> tuple[Daemon, int, int]:
    """Two echo replicas with the spec's adapter `sql` (a path relative to the spec file),
    behind the gateway and each on a port of its own; (daemon, gateway port, first replica
    port)."""
    _adapter(root / "sql")
    gateway, base = free_port(), free_port_range(2)
    d = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo",
                  "adapters": {"sql": "../sql"}}],  # the spec is root/d0/fleet.yaml
                supervisor={"gateway": f"127.0.0.1:{gateway}", "replica_ports": base,
                            **supervisor})
    return d, gateway, base


def _every_replica_answers(gateway: int, base: int, model: str, want: str) -> None:
    """Through the gateway (several requests: both replicas take some) and on each replica's
    own port, the adapter answers `want`."""
    assert [_text(gateway, model) for _ in range(6)] == [want] * 6
    assert [_text(port, model) for port in (base, base + 1)] == [want] * 2


@pytest.mark.smoke
def test_spec_and_runtime_adapters_answer_everywhere_survive_a_kill_and_unload(engined,
                                                                            short_tmp):
    """(A transformers engine takes no adapter: a load for one is a 400 naming its backend,
    tests/unit/test_lora_gateway.py, without starting one here.)"""
    d, gateway, base = _start(engined, short_tmp)
    models = _models(gateway)
    assert models["sql"]["parent"] == "echo" and models["sql"]["root"] == "echo", models
    assert "parent" not in models["echo"], models["echo"]
    _every_replica_answers(gateway, base, "sql", f"[sql] {PROMPT}")
    assert _text(gateway, "echo") == PROMPT  # the base model has no adapter
    client = _client(gateway)  # streamed, and chat: the same adapter
    assert "".join(c.choices[0].text for c in client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=64, stream=True)) == f"[sql] {PROMPT}"
    chat = client.chat.completions.create(model="sql", messages=[
        {"role": "user", "content": "hello"}])
    assert chat.choices[0].message.content == "[sql] hello" and chat.model == "sql", chat

    poet = _adapter(short_tmp / "poet")
    loaded = _post_to(gateway, "/v1/load_lora_adapter", {"lora_name": "poet",
                                                      "lora_path": str(poet)})
    assert loaded == (200, "Success: LoRA adapter 'poet' added successfully."), loaded
    assert _post_to(gateway, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(poet),
                                                    "model": "echo"})[0] == 200  # idempotent
    models = _models(gateway)
    assert sorted(models) == ["echo", "poet", "sql"], models
    assert models["poet"]["parent"] == "echo", models["poet"]
    answer = f"[poet] {PROMPT}"
    _every_replica_answers(gateway, base, "poet", answer)

    victim = _pids(d)["echo-0"]
    os.kill(victim, signal.SIGKILL)
    d.wait_restarted("echo-0", victim)
    assert _pids(d)["echo-0"] != victim
    # the new echo-0 has it (its config at spawn) before it takes a request: its own port
    # answers at once, the same text
    assert _text(base, "poet") == answer and _text(base, "sql") == f"[sql] {PROMPT}"
    _every_replica_answers(gateway, base, "poet", answer)

    assert _post_to(gateway, "/v1/unload_lora_adapter", {"lora_name": "poet"}) == (
        200, "Success: LoRA adapter 'poet' removed successfully.")
    assert sorted(_models(gateway)) == ["echo", "sql"]
    for port in (gateway, base, base + 1):
        with pytest.raises(openai.NotFoundError) as gone:
            _text(port, "poet")
        assert gone.value.code == "model_not_found", gone.value.body
    status, error = _error(_post_to(gateway, "/v1/unload_lora_adapter", {"lora_name": "poet"}))
    assert status == 404 and error["param"] == "lora_name", error

    # what is refused, and why
    status, error = _error(_post_to(gateway, "/v1/load_lora_adapter", {
        "lora_name": "bad", "lora_path": str(short_tmp / "nowhere")}))
    assert status == 400 and error["param"] == "lora_path" and "lora_path" in error["message"]
    status, error = _error(_post_to(gateway, "/v1/load_lora_adapter", {
        "lora_name": "bad", "lora_path": "sql"}))  # relative: not an adapter's directory
    assert status == 400 and error["param"] == "lora_path", error
    status, error = _error(_post_to(gateway, "/v1/unload_lora_adapter", {"lora_name": "sql"}))
    assert status == 400 and "in the spec" in error["message"], error
    status, error = _error(_post_to(gateway, "/v1/load_lora_adapter", {"lora_path": str(poet)}))
    assert status == 400 and error["param"] == "lora_name", error
    status, error = _error(_post_to(gateway, "/v1/load_lora_adapter", {
        "lora_name": "poet", "lora_path": str(poet), "model": "nope"}))
    assert status == 404 and error["code"] == "model_not_found", error
    status, error = _error(_post_to(gateway, "/v1/load_lora_adapter", {
        "lora_name": "echo", "lora_path": str(poet)}))  # the base model's own name
    assert status == 400 and error["param"] == "lora_name", error
    assert sorted(_models(gateway)) == ["echo", "sql"]  # nothing refused was recorded
    assert _text(gateway, "sql") == f"[sql] {PROMPT}"


def test_a_runtime_adapter_whose_directory_went_away_is_left_out_of_a_restart(engined,
                                                                              short_tmp):
    """Removed from disk after its load, a run-time adapter is not in the next start's config
    (where it would be a config error: exit 78, FAILED for good): the replica restarts
    without it and serves the rest; its sibling still serves it; once the directory is back,
    the next start has it again."""
    d, gateway, base = _start(engined, short_tmp)
    poet = _adapter(short_tmp / "poet")
    assert _post_to(gateway, "/v1/load_lora_adapter", {"lora_name": "poet",
                                                    "lora_path": str(poet)})[0] == 200
    config = (poet / "adapter_config.json").read_text()
    shutil.rmtree(poet)
    victim = _pids(d)["echo-0"]
    os.kill(victim, signal.SIGKILL)
    d.wait_restarted("echo-0", victim)
    assert _text(base, "sql") == f"[sql] {PROMPT}"  # the restarted replica serves the rest
    assert [_text(gateway, "poet") for _ in range(4)] == [f"[poet] {PROMPT}"] * 4  # echo-1
    assert "adapter poet: " in d.stderr_text() and "start without it" in d.stderr_text()

    poet.mkdir()
    (poet / "adapter_config.json").write_text(config)
    victim = _pids(d)["echo-0"]
    os.kill(victim, signal.SIGKILL)
    d.wait_restarted("echo-0", victim)
    assert _text(base, "poet") == f"[poet] {PROMPT}"


# --- what survives the daemon: an upgrade in place, a crash adoption ------------------------


def _saved_adapters(d: Daemon) -> dict[str, dict[str, str]]:
    try:
        return json.loads((d.runtime_dir / "state.json").read_text()).get("adapters", {})
    except (OSError, ValueError):
        return {}


def _both_replicas_hold(d: Daemon, gateway: int, model: str, want: str) -> None:
    """Two slow requests for `model` at once through the gateway run one on each replica (the
    router takes the least loaded among those that hold the adapter): both hold it."""
    prompt = "x" * 60  # with the prefix 67 tokens at 20 ms: over a second each
    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(_text(gateway, model, prompt)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        d.wait_for(lambda: {n: (e["queue"] or {}).get("running") for n, e in
                            d.engines().items()} == {"echo-0": 1, "echo-1": 1}, 10,
                   f"a request for {model} running on each replica")
    finally:
        for thread in threads:
            thread.join(30)
    assert texts == [want.replace(PROMPT, prompt)] * 2, texts


@pytest.mark.slow
def test_a_runtime_adapter_survives_an_upgrade_a_kill_and_a_crash_adoption(engined,
                                                                           short_tmp):
    """Without replica_ports (an upgrade does not keep them yet:
    test_replica_ports_upgrade.py): which replicas hold the adapter is seen by where two
    requests at once run."""
    _adapter(short_tmp / "sql")
    gateway = free_port()
    d = engined([{"name": "echo", "replicas": 2, "model": "builtin:echo",
                  "adapters": {"sql": "../sql"}, "env": {"ENGINED_ECHO_TOKEN_MS": "20"}}],
                supervisor={"gateway": f"127.0.0.1:{gateway}", "orphan_timeout": "60s"})
    poet = _adapter(short_tmp / "poet")
    assert _post_to(gateway, "/v1/load_lora_adapter", {"lora_name": "poet",
                                                    "lora_path": str(poet)})[0] == 200
    answer = f"[poet] {PROMPT}"
    assert _text(gateway, "poet") == answer
    _both_replicas_hold(d, gateway, "poet", answer)

    # an upgrade in place: the same engines, the adapter still listed and answering on both
    before = _pids(d)
    done = d.ctl("upgrade")
    assert done.returncode == 0, done.stderr
    d.wait_all_ready()
    assert _pids(d) == before
    assert _models(gateway)["poet"]["parent"] == "echo"
    assert _text(gateway, "poet") == answer
    _both_replicas_hold(d, gateway, "poet", answer)
    # the new code restarts a killed replica with it
    os.kill(before["echo-1"], signal.SIGKILL)
    d.wait_restarted("echo-1", before["echo-1"])
    _both_replicas_hold(d, gateway, "poet", answer)

    # a crash: SIGKILL engined once its snapshot has the adapter; the next one adopts the
    # engines and knows the adapter
    d.wait_for(lambda: _saved_adapters(d) == {"echo": {"poet": str(poet)}}, 10,
               "the snapshot to have the adapter")
    before = _pids(d)
    tree = spawned_tree(d)
    d.expect_unclean_exit = True
    d.signal(signal.SIGKILL)
    assert d.wait_exit(timeout_s=10) == -signal.SIGKILL
    try:
        d.expect_unclean_exit = False
        d.start()
        d.wait_all_ready()
        engines = d.engines()
        assert {n: e["pid"] for n, e in engines.items()} == before
        assert all(e["adopted_at"] for e in engines.values()), engines
        assert _models(gateway)["poet"]["parent"] == "echo"
        assert _text(gateway, "poet") == answer
        assert _text(gateway, "sql") == f"[sql] {PROMPT}"
        _both_replicas_hold(d, gateway, "poet", answer)
        # still supervised, still with it: a kill is a restart that has the adapter
        os.kill(before["echo-0"], signal.SIGKILL)
        d.wait_restarted("echo-0", before["echo-0"])
        _both_replicas_hold(d, gateway, "poet", answer)
        # unloaded under the adopting engined: gone, and not back after a restart
        assert _post_to(gateway, "/v1/unload_lora_adapter", {"lora_name": "poet"})[0] == 200
        victim = _pids(d)["echo-1"]
        os.kill(victim, signal.SIGKILL)
        d.wait_restarted("echo-1", victim)
        assert sorted(_models(gateway)) == ["echo", "sql"]
        with pytest.raises(openai.NotFoundError):
            _text(gateway, "poet")
        _both_replicas_hold(d, gateway, "sql", f"[sql] {PROMPT}")
        assert d.stop() == 0
    finally:
        for pid in tree:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


def _post_to(port: int, route: str, body: Any) -> tuple[int, str]:
    """A LoRA route: (status, the answer's text; vLLM's success answer is plain text)."""
    return http_text("POST", f"http://127.0.0.1:{port}{route}", body)
