"""The gateway's LoRA routes, with vLLM's shapes: `POST /v1/load_lora_adapter` (`lora_name`,
`lora_path`) and `POST /v1/unload_lora_adapter` (`lora_name`), plus `model` (engined's: the base
model whose group takes it, needed when several could). A load is applied to every live replica
of the group and recorded (routing.adapters): every later start, restart, wake or promotion of
the group's replicas has it before they take its requests. `replay` brings a replica that became
READY up to date.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engined.engine import protocol as proto
from engined.supervisor.gateway.openai import ApiError
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.ipc import EngineChannels, RequestFailed, new_request_id, result_of
from engined.supervisor.routing.adapters import AdapterBook
from engined.supervisor.routing.routes import Routes

log = logging.getLogger("engined.gateway")

TASK_TIMEOUT_S = 120.0  # loading an adapter reads its weights
Address = tuple[str, int]
Life = tuple[Address, tuple[str, int], bool]  # (incarnation, its HTTP endpoint, a command engine)
# An engine re-attached after an upgrade is READY once the request channel reaches it, and a
# send to it can still fail for a moment after (EHOSTUNREACH: seen in tests/e2e/test_lora.py):
# a replay tries a task the channel could not send again, for this long.
REPLAY_UNSENT_RETRY_S = 5.0
UNSENT_RETRY_STEP_S = 0.02


class _Unsent(Exception):
    """The engine channel could not send the task: nothing reached the engine."""


class Lora:
    def __init__(self, router: Routes, book: AdapterBook, channels: EngineChannels,
                 upstream: Upstream, lives: Callable[[str], list[Life]] | None) -> None:
        self.router, self.book, self.channels, self.upstream = router, book, channels, upstream
        self.lives = lives  # the serving incarnations of a group (None: a cluster gateway)
        self._replays: set[asyncio.Task[None]] = set()  # replays running (supervisor.services)

    async def load(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name, path = _text(body, "lora_name"), _text(body, "lora_path")
        group = self._group(body, name)
        if not os.path.isabs(path) or not os.path.isfile(os.path.join(path,
                                                                       "adapter_config.json")):
            raise ApiError(400, f"lora_path {path!r} is not an adapter's directory (an absolute "
                                f"path holding adapter_config.json)", param="lora_path")
        if self.router.models().get(name, group) != group or name in self.router.models() \
                and name not in self.book.served(group):
            raise ApiError(400, f"'{name}' already names a model served here", param="lora_name")
        known = self.book.served(group).get(name)
        if known is not None and known != path:
            how = "change it in the spec (adapters:) and reload" \
                if name in self.book.declared(group) else "unload it first"
            raise ApiError(400, f"the adapter '{name}' is loaded from {known}: {how}",
                           param="lora_name")
        errors = await self._everywhere(group, name, path)
        if errors and len(errors) == len(self._lives(group)):
            raise ApiError(400, f"the adapter '{name}' could not be loaded: {errors[0]}",
                           param="lora_path")
        if name not in self.book.declared(group):
            self.book.add(group, name, path)
        log.info("[lora] %s: adapter %s loaded from %s (%s)", group, name, path,
                 f"{len(errors)} replica(s) failed: {errors[0]}" if errors else "every replica")
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name = _text(body, "lora_name")
        group = self._group(body, name)
        if name in self.book.declared(group):
            raise ApiError(400, f"the adapter '{name}' is in the spec (adapters:): remove it "
                                f"there and reload", param="lora_name")
        if name not in self.book.served(group):
            raise ApiError(404, f"no adapter '{name}' is loaded", param="lora_name",
                           code="not_found")
        self.book.remove(group, name)
        await self._everywhere(group, name, None)
        log.info("[lora] %s: adapter %s unloaded", group, name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _group(self, body: dict[str, Any], name: str) -> str:
        if self.lives is None:
            raise ApiError(400, "a cluster gateway loads no adapters: load them on the nodes")
        models = self.router.models()
        base = body.get("model")
        if isinstance(base, str) and base:
            if base not in models:
                raise ApiError(404, f"The model '{base}' does not exist", param="model",
                               code="model_not_found")
            group = models[base]
        else:
            owners = {g for n, g in self.book.models().items() if n == name}
            groups = owners or {g for g in models.values() if self._takes(g)}
            if not groups:
                raise ApiError(400, "no model served here takes LoRA adapters: they need "
                                    "backend: vllm (or a vLLM server)", param="model")
            if len(groups) != 1:
                raise ApiError(400, "name the base model ('model': one of GET /v1/models): "
                                    f"{len(groups)} could take the adapter", param="model")
            group = groups.pop()
        if not self._takes(group):
            runs = self.router.route_of(group).backend or "a server of its own"
            raise ApiError(400, f"LoRA adapters need backend: vllm (or a vLLM server): the "
                                f"model '{base or group}' runs {runs}", param="model")
        return group

    def _takes(self, group: str) -> bool:
        route = self.router.route_of(group)
        return route.vllm or route.backend in ("vllm", "builtin:echo")

    def _lives(self, group: str) -> list[Life]:
        return self.lives(group) if self.lives is not None else []

    async def _everywhere(self, group: str, name: str, path: str | None) -> list[str]:
        """(Un)load on every serving incarnation of `group`; the errors."""
        results = await asyncio.gather(*(self.apply(life, name, path)
                                         for life in self._lives(group)))
        return [error for error in results if error is not None]

    async def apply(self, life: Life, name: str, path: str | None,
                    unsent_retry_s: float = 0.0) -> str | None:
        """Load (`path`) or unload one adapter on one incarnation; the error, or None.
        `unsent_retry_s`: how long a task the engine channel cannot send yet is tried again."""
        address, endpoint, command = life
        loop = asyncio.get_running_loop()
        deadline = loop.time() + unsent_retry_s
        while True:
            try:
                if command:
                    error = await self._over_http(endpoint, name, path)
                else:
                    error = await self._over_channel(address, name, path)
            except _Unsent as exc:
                if loop.time() < deadline:
                    await asyncio.sleep(UNSENT_RETRY_STEP_S)
                    continue
                error = f"{address[0]}: {exc}"
            except (RequestFailed, asyncio.TimeoutError, OSError, ValueError) as exc:
                error = f"{address[0]}: {exc or type(exc).__name__}"
            break
        if error is None:
            held = self.book.held.setdefault(address, set())
            held.add(name) if path is not None else held.discard(name)
        return error

    async def _over_channel(self, address: Address, name: str, path: str | None) -> str | None:
        task = proto.TASK_LOAD_ADAPTER if path is not None else proto.TASK_UNLOAD_ADAPTER
        try:
            stream = self.channels.open(address, proto.GenerateRequest(
                new_request_id(), task=task, adapter=name, adapter_path=path or ""))
        except RequestFailed as exc:
            raise _Unsent(str(exc)) from None
        item = await result_of(stream, TASK_TIMEOUT_S)
        if item is None:
            return f"{address[0]}: an unexpected answer"
        return None if item.error is None else f"{address[0]}: {item.error}"

    async def _over_http(self, endpoint: tuple[str, int], name: str,
                         path: str | None) -> str | None:
        route = "/v1/load_lora_adapter" if path is not None else "/v1/unload_lora_adapter"
        body = {"lora_name": name, **({"lora_path": path} if path is not None else {})}
        status, _, text = await asyncio.wait_for(
            self.upstream.fetch(endpoint, "POST", route, json.dumps(body).encode()),
            TASK_TIMEOUT_S)
        if status == 200 or (path is None and status == 404):
            return None
        return f"{endpoint[0]}:{endpoint[1]}: HTTP {status}: {text.decode(errors='replace')[:300]}"

    def replay_soon(self, group: str, life: Life) -> None:
        """`replay` in the background (its task kept until it ends)."""
        task = asyncio.get_running_loop().create_task(self.replay(group, life))
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def replay(self, group: str, life: Life) -> None:
        """A replica of `group` became READY: load what it lacks (a server engined did not
        write holds none; an engine child holds what its config named)."""
        missing = {n: p for n, p in self.book.of_group(group).items()
                   if not self.book.holds(life[0], n)}
        for name, path in missing.items():
            error = await self.apply(life, name, path, REPLAY_UNSENT_RETRY_S)
            if error is not None:
                log.warning("[lora] %s: adapter %s not loaded on %s: %s", group, name,
                            life[0][0], error)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the JSON body must be an object")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{key}' is required (a non-empty string)", param=key)
    return value


__all__ = ["Lora"]
