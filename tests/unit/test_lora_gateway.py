"""The gateway's LoRA routes' decisions (supervisor.gateway.lora), on a table of fleets, without
a daemon: which group a load or an unload is for, what is refused before any engine is asked
(a backend without adapters, an unknown model, a cluster gateway, a path that is no adapter's
directory, a name taken), and what is recorded (routing.adapters.AdapterBook). With no live
replica (`lives` empty) nothing is sent to an engine: the end-to-end tier
(tests/e2e/test_lora.py) drives real ones."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from engined.engine import protocol as proto
from engined.supervisor.gateway import lora as lora_module
from engined.supervisor.gateway.lora import Lora
from engined.supervisor.gateway.openai import ApiError
from engined.supervisor.ipc import RequestFailed
from engined.supervisor.routing.adapters import AdapterBook
from engined.supervisor.routing.routes import Route

# group -> (backend, a vLLM OpenAI server)
FLEET = {"echo": ("builtin:echo", False), "tiny": ("transformers", False),
         "big": ("vllm", False), "serve": ("command", True)}


class _Routes:
    """What Lora reads of the router: the models served and each group's route."""

    def __init__(self, groups: dict[str, tuple[str, bool]]) -> None:
        self.groups = groups

    def models(self) -> dict[str, str]:
        return {group: group for group in self.groups}

    def route_of(self, group: str) -> Route:
        backend, vllm = self.groups[group]
        return Route(queue_limit=1, request_timeout_s=1.0, migration_limit=0,
                     proxied=backend == "command", vllm=vllm,
                     backend="" if backend == "command" else backend)


class _Request:
    def __init__(self, body: Any) -> None:
        self.body = body

    async def json(self) -> Any:
        return self.body


def _lora(groups: list[str], declared: dict[str, dict[str, str]] | None = None,
          cluster: bool = False) -> Lora:
    book = AdapterBook(lambda: ((g, tuple(sorted((declared or {}).get(g, {}).items())))
                                for g in groups))
    routes = _Routes({g: FLEET[g] for g in groups})
    return Lora(routes, book, None, None,  # type: ignore[arg-type]
                None if cluster else (lambda group: []))


def _answer(lora: Lora, route: str, body: Any) -> tuple[int, str, str | None]:
    """(status, the text or the error's message, the error's param)."""
    handler = lora.load if route == "load" else lora.unload
    try:
        response = asyncio.run(handler(_Request(body)))  # type: ignore[arg-type]
    except ApiError as exc:
        return exc.status, exc.message, exc.param
    return response.status, response.text or "", None


@pytest.fixture
def adapter(tmp_path: Path) -> str:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(tmp_path)


@pytest.mark.parametrize("groups, model, status, words", [
    # a transformers engine takes none: named, or the only model
    (["echo", "tiny"], "tiny", 400,
     "LoRA adapters need backend: vllm (or a vLLM server): the model 'tiny' runs transformers"),
    (["tiny"], None, 400, "no model served here takes LoRA adapters: they need backend: vllm"),
    # the one group that can is chosen; with two, the base model must be named
    (["echo", "tiny"], None, 200, "Success: LoRA adapter 'a' added successfully."),
    (["echo", "big"], None, 400, "name the base model ('model': one of GET /v1/models): 2 could"),
    (["echo", "big"], "big", 200, "Success"),
    (["tiny", "serve"], None, 200, "Success"),  # a `vllm serve` command engine takes them
    (["echo"], "nope", 404, "The model 'nope' does not exist"),
])
def test_which_group_takes_a_load(adapter: str, groups: list[str], model: str | None,
                                  status: int, words: str):
    lora = _lora(groups)
    body = {"lora_name": "a", "lora_path": adapter, **({"model": model} if model else {})}
    got, text, param = _answer(lora, "load", body)
    assert (got, text[:len(words)]) == (status, words), text
    if status == 200:
        (group,) = [g for g in groups if g == model or model is None and g != "tiny"]
        assert lora.book.loaded == {group: {"a": adapter}}
    else:
        assert param == "model" and lora.book.loaded == {}, param


@pytest.mark.parametrize("body, status, param", [
    ({"lora_path": "ADAPTER"}, 400, "lora_name"),
    ({"lora_name": "", "lora_path": "ADAPTER"}, 400, "lora_name"),
    ({"lora_name": "a"}, 400, "lora_path"),
    ({"lora_name": "a", "lora_path": "relative/dir"}, 400, "lora_path"),
    ({"lora_name": "a", "lora_path": "/nowhere"}, 400, "lora_path"),
    ({"lora_name": "echo", "lora_path": "ADAPTER"}, 400, "lora_name"),  # the base model's name
    ({"lora_name": "sql", "lora_path": "/other/dir"}, 400, "lora_path"),  # not a directory
    ({"lora_name": "sql", "lora_path": "ADAPTER"}, 400, "lora_name"),  # the spec's, elsewhere
    (["a"], 400, None),
])
def test_what_a_load_refuses_before_any_engine_is_asked(adapter: str, body: Any, status: int,
                                                        param: str | None):
    lora = _lora(["echo"], declared={"echo": {"sql": "/models/sql"}})
    if isinstance(body, dict):
        body = {k: adapter if v == "ADAPTER" else v for k, v in body.items()}
    got, text, where = _answer(lora, "load", body)
    assert (got, where) == (status, param), text
    assert lora.book.loaded == {}


def test_a_name_loaded_from_elsewhere_says_how_to_change_it(adapter: str, tmp_path: Path):
    lora = _lora(["echo"], declared={"echo": {"sql": "/models/sql"}})
    assert _answer(lora, "load", {"lora_name": "sql", "lora_path": adapter})[1] == (
        "the adapter 'sql' is loaded from /models/sql: change it in the spec (adapters:) and "
        "reload")  # the spec's cannot be unloaded through the gateway
    assert _answer(lora, "load", {"lora_name": "a", "lora_path": adapter})[0] == 200
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    assert _answer(lora, "load", {"lora_name": "a", "lora_path": str(other)})[1] == (
        f"the adapter 'a' is loaded from {adapter}: unload it first")


def test_unload_refuses_the_specs_and_unknown_adapters_and_forgets_a_loaded_one(adapter: str):
    lora = _lora(["echo"], declared={"echo": {"sql": "/models/sql"}})
    assert _answer(lora, "unload", {"lora_name": "sql"})[:2] == (
        400, "the adapter 'sql' is in the spec (adapters:): remove it there and reload")
    assert _answer(lora, "unload", {"lora_name": "a"})[0] == 404
    assert _answer(lora, "load", {"lora_name": "a", "lora_path": adapter})[0] == 200
    assert lora.book.models() == {"a": "echo", "sql": "echo"}
    assert _answer(lora, "unload", {"lora_name": "a"}) == (
        200, "Success: LoRA adapter 'a' removed successfully.", None)
    assert lora.book.models() == {"sql": "echo"} and lora.book.loaded == {"echo": {}}


def test_a_cluster_gateway_loads_none(adapter: str):
    lora = _lora(["echo"], cluster=True)
    status, text, _ = _answer(lora, "load", {"lora_name": "a", "lora_path": adapter})
    assert status == 400 and "load them on the nodes" in text


def test_a_start_is_given_the_run_times_adapters_whose_directory_is_still_one(
        adapter: str, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """AdapterBook.of_group is what a starting replica's config gets: a run-time adapter whose
    directory went away is left out (said once) but still served; back, it is given again."""
    lora = _lora(["echo"], declared={"echo": {"sql": "/models/sql"}})
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    for name, path in (("a", adapter), ("b", str(gone))):
        assert _answer(lora, "load", {"lora_name": name, "lora_path": path})[0] == 200
    book = lora.book
    assert book.of_group("echo") == {"sql": "/models/sql", "a": adapter, "b": str(gone)}
    (gone / "adapter_config.json").unlink()
    with caplog.at_level("WARNING", "engined.routing"):
        assert book.of_group("echo") == {"sql": "/models/sql", "a": adapter}
        assert book.of_group("echo") == {"sql": "/models/sql", "a": adapter}
    assert [r.getMessage() for r in caplog.records] == [
        f"[lora] echo: adapter b: {gone} holds no adapter_config.json any more: replicas that "
        f"start now start without it"]
    assert book.served("echo") == {"sql": "/models/sql", "a": adapter, "b": str(gone)}
    assert book.models() == {"a": "echo", "b": "echo", "sql": "echo"}
    (gone / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    assert book.of_group("echo")["b"] == str(gone)


class _Stream:
    def __init__(self, result: proto.GenerateResult) -> None:
        self.result = result

    async def next(self, timeout_s: float) -> proto.GenerateResult:
        return self.result

    def close(self) -> None:
        pass


class _Channels:
    """An engine channel that cannot send the first `unsent` tasks (as right after an adopted
    engine re-attached), then answers each with `error`."""

    def __init__(self, unsent: int, error: str | None = None) -> None:
        self.unsent, self.error, self.sent = unsent, error, 0

    def open(self, address: tuple[str, int], request: proto.GenerateRequest) -> _Stream:
        if self.unsent:
            self.unsent -= 1
            raise RequestFailed(f"cannot send to {address[0]}:{address[1]}: Host unreachable")
        self.sent += 1
        return _Stream(proto.GenerateResult(request.id, address[0], address[1],
                                            error=self.error))


LIFE = (("echo-0", 1), ("127.0.0.1", 0), False)


def _replayed(lora: Lora) -> None:
    asyncio.run(lora.replay("echo", LIFE))


def test_a_replay_tries_a_task_the_channel_could_not_send_yet_again(adapter: str):
    lora = _lora(["echo"])
    lora.book.add("echo", "a", adapter)
    lora.channels = _Channels(unsent=3)  # type: ignore[assignment]
    _replayed(lora)
    assert lora.book.holds(LIFE[0], "a") and lora.channels.sent == 1  # type: ignore[attr-defined]


def test_a_replay_does_not_retry_what_the_engine_refused_and_gives_up_on_an_unsent_one(
        adapter: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    lora = _lora(["echo"])
    lora.book.add("echo", "a", adapter)
    refusing = _Channels(unsent=0, error="adapter 'a': no")
    lora.channels = refusing  # type: ignore[assignment]
    _replayed(lora)
    assert refusing.sent == 1 and not lora.book.holds(LIFE[0], "a")
    monkeypatch.setattr(lora_module, "REPLAY_UNSENT_RETRY_S", 0.05)
    lora.channels = _Channels(unsent=1_000_000)  # type: ignore[assignment]
    with caplog.at_level("WARNING", "engined.gateway"):
        _replayed(lora)
    assert not lora.book.holds(LIFE[0], "a")
    assert "[lora] echo: adapter a not loaded on echo-0: echo-0: cannot send to echo-0:1: " \
           "Host unreachable" in caplog.text
    # a load through the gateway is not retried: its answer says what happened at once
    lora.channels = _Channels(unsent=1)  # type: ignore[assignment]
    assert asyncio.run(lora.apply(LIFE, "a", adapter)) == (
        "echo-0: cannot send to echo-0:1: Host unreachable")
