"""The OpenAI-compatible gateway: POST /v1/completions, POST /v1/chat/completions (SSE when
`stream: true`), GET /v1/models, served by aiohttp on `supervisor.gateway` (off by default).

The model name is the engine group's `served_model_name` (its name by default). An optional
bearer token comes from `supervisor.api_key_file` (re-read on reload). Every answer carries an
`X-Request-Id` (the client's, if it sent a sane one), which the daemon's log lines name too.
Counted: engined_gateway_requests_total{model,outcome} (ok, error, timeout, rejected,
client_gone), engined_gateway_migrations_total{model}, time to first token and latency
(gateway.admission). The routes read the router only through its Routes (routing.routes): the
fleet's replicas, or a cluster gateway's nodes.
GET /metrics here is the inference gateway's model server protocol (serverstats), asked no
token. With `supervisor.replica_ports`, the same app serves each replica on a port of its own,
pinned to it (routes.PINNED).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engined.supervisor import __version__
from engined.supervisor.gateway import responses, serverstats, tokens
from engined.supervisor.gateway.admission import Admission
from engined.supervisor.gateway.choices import Choices
from engined.supervisor.gateway.lora import Lora
from engined.supervisor.gateway.openai import (
    ApiError,
    Batch,
    Usage,
    check_backend,
    parse_chat,
    parse_completion,
)
from engined.supervisor.gateway.proxy import Proxy
from engined.supervisor.gateway.relay import Relay
from engined.supervisor.gateway.stats import GatewayStats
from engined.supervisor.gateway.upstream import Upstream
from engined.supervisor.ipc import EngineChannels
from engined.supervisor.routing.adapters import ADAPTER
from engined.supervisor.routing.routes import PINNED, Routes, UnknownModel
from engined.supervisor.webserver import ApiKey, BodyTimeout, read_body

MAX_BODY_BYTES = 8 << 20
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
PINNED_KEY = web.AppKey("pinned", str)  # the replica a port serves (replica_ports)


class Gateway:
    """The routes: what each one reads of a request and who answers it (engined's own engines
    through the relay, a server's through the proxy, both behind the router's Routes); every
    request goes through the admission."""

    def __init__(self, router: Routes, channels: EngineChannels, upstream: Upstream,
                 api_key: ApiKey, clock: Callable[[], float] = time.monotonic,
                 on_counted: Callable[[], None] = lambda: None, lora: Lora | None = None) -> None:
        self.router, self.api_key, self.clock = router, api_key, clock
        self.admission = Admission(router, clock, on_counted)  # on_counted: a snapshot is due
        self.channels = channels
        moved, first = self.admission.moved, self.admission.first
        self.relay = Relay(router, channels, clock, on_move=moved)
        self.choices = Choices(self.relay, clock, first)
        self.proxy = Proxy(router, upstream, clock, on_move=moved, on_first=first)
        self.lora = lora  # LoRA adapters' routes (gateway.lora)

    @property
    def stats(self) -> GatewayStats:
        return self.admission.stats

    @property
    def active(self) -> int:
        """Requests in flight."""
        return self.admission.active

    def make_app(self, pinned: str | None = None) -> web.Application:
        """The gateway's routes; `pinned`: a replica's own port (supervisor.replica_ports),
        where requests go to that replica (and move to its siblings only if it dies)."""
        middlewares = [self._errors, self._auth]
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._pin, *middlewares] if pinned else middlewares)
        if pinned:
            app[PINNED_KEY] = pinned
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.tokenize)
        app.router.add_get("/metrics", self.metrics)  # the inference gateway's protocol
        if self.lora is not None:
            app.router.add_post("/v1/load_lora_adapter", self.lora.load)
            app.router.add_post("/v1/unload_lora_adapter", self.lora.unload)
        app.router.add_route("*", "/v1/{tail:.*}", self.by_model)  # the rest of a server's API
        return app

    async def drained(self, timeout_s: float) -> bool:
        """Until no request is in flight (shutdown: finish what runs), at most `timeout_s`."""
        return await self.admission.drained(timeout_s)

    # --- middlewares -------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "")
        if not _REQUEST_ID_RE.fullmatch(rid):
            rid = uuid.uuid4().hex
        request["request_id"] = rid
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _api_error(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _api_error(ApiError(exc.status, exc.reason,
                                           kind="invalid_request_error"))
        if not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

    @web.middleware
    async def _pin(self, request: web.Request, handler: Any) -> web.StreamResponse:
        token = PINNED.set(request.app[PINNED_KEY])
        try:
            return await handler(request)
        finally:
            PINNED.reset(token)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        asked = request.path != "/metrics"  # scraped without a token, as vLLM's own
        if asked and not self.api_key.allows(request.headers.get("Authorization")):
            raise ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer "
                                "<token>' (the token in engined's api_key_file)",
                           kind="authentication_error", code="invalid_api_key")
        return await handler(request)

    # --- routes ------------------------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's gauges per model (serverstats): the endpoint picker's model server protocol."""
        text = serverstats.render(self.router, sorted(self.router.models().items()))
        return web.Response(body=text.encode(),
                            headers={"Content-Type": serverstats.CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        adapters = self.lora.book.models() if self.lora is not None else {}
        data = [{"id": name, "object": "model", "created": created, "owned_by": "engined",
                 "root": group, **({"parent": group} if name in adapters else {})}
                for name, group in sorted(self.router.models().items())]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        group = self._group_of(name)
        return web.json_response({"id": name, "object": "model", "created": int(time.time()),
                                  "owned_by": "engined", "root": group})

    async def version(self, request: web.Request) -> web.StreamResponse:
        """A vLLM server's version when the gateway serves one, else engined's."""
        groups = sorted({g for g in self.router.models().values()
                         if self.router.route_of(g).vllm})
        if not groups:
            return web.json_response({"version": __version__, "engined": __version__})
        return await self.admission.serve(
            request, None, groups[0], lambda deadline, limit: self.proxy.forward(
                request, "/version", None, None, groups[0], deadline, limit))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/completions", parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "/v1/chat/completions", parse_chat)

    async def _completion(self, request: web.Request, path: str,
                          parse: Callable[[dict[str, Any], str], Batch]) -> web.StreamResponse:
        body = await _body(request)
        model, group = self._model_group(body)
        if self._proxied(group):  # a command engine: its own server reads the body
            return await self.admission.serve(
                request, model, group, lambda deadline, limit: self.proxy.forward(
                    request, path, body, model, group, deadline, limit))
        backend = self.router.route_of(group).backend
        batch = parse(body, backend)
        check_backend(batch, backend)
        return await self.admission.serve(
            request, model, group, lambda deadline, limit: self._relayed(
                request, batch, group, deadline, limit))

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        """vLLM's /tokenize and /detokenize: the model's server answers (a command engine), or
        one of its engines with its own tokenizer. `model` may be left out when one is served."""
        body = await _body(request)
        models = self.router.models()
        if body.get("model") is None and len(models) == 1:
            body = {**body, "model": next(iter(models))}
        model, group = self._model_group(body)
        if self._proxied(group):
            return await self.by_model(request, body)
        detokenize = request.path == "/detokenize"
        ask = tokens.detokenize_request(body) if detokenize else tokens.tokenize_request(body)

        async def run(deadline: float, limit: int) -> tuple[str, web.StreamResponse]:
            result = await tokens.ask(self.router, self.channels, self.clock, group, ask,
                                      deadline, limit)
            return "ok", web.json_response(tokens.answer(ask, result))
        return await self.admission.serve(request, model, group, run)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: a command engine's server answers it, engined's own engines
        as a chat (gateway.responses)."""
        body = await _body(request)
        model, group = self._model_group(body)
        if self._proxied(group):
            return await self.by_model(request, body)
        job = responses.parse(body)
        rid = request["request_id"]

        async def run(deadline: float, limit: int) -> tuple[str, web.StreamResponse]:
            reply = responses.Reply(job, rid, body, self.clock, self.admission.first)
            answer = self.relay.run(job, group, rid, deadline, limit)
            try:
                if job.stream:
                    return await reply.stream(request, answer)
                return await reply.whole(answer)
            finally:
                await answer.aclose()
        return await self.admission.serve(request, model, group, run)

    async def by_model(self, request: web.Request,
                       body: dict[str, Any] | None = None) -> web.StreamResponse:
        """Any other route of a command engine's server, for the model the body names."""
        path = request.path
        if body is None and request.method == "POST":
            body = await _body(request)
        if body is None:
            raise ApiError(404, f"{request.method} {path} is not served here (a request that "
                                f"names its model in a JSON body is passed to that model's "
                                f"server)", code="not_found")
        model, group = self._model_group(body)
        if not self._proxied(group):
            raise ApiError(404, f"{path} is not served for model '{model}' (engined's own "
                                f"engines answer /v1/completions and /v1/chat/completions)",
                           code="not_found")
        return await self.admission.serve(
            request, model, group, lambda deadline, limit: self.proxy.forward(
                request, path, body, model, group, deadline, limit))

    def _model_group(self, body: dict[str, Any]) -> tuple[str, str]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required: one of GET /v1/models", param="model")
        group = self._group_of(model)
        if self.lora is not None and self.lora.book.models().get(model) == group:
            ADAPTER.set(model)  # its requests go to replicas that hold it, and name it
        return model, group

    def _group_of(self, model: str) -> str:
        try:
            return self.router.group_of(model)
        except UnknownModel as exc:
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None

    def _proxied(self, group: str) -> bool:
        return self.router.route_of(group).proxied

    async def _relayed(self, request: web.Request, batch: Batch, group: str, deadline: float,
                       limit: int) -> tuple[str, web.StreamResponse]:
        """A request to engined's own engines: each choice relayed (it survives their deaths)."""
        return await self.choices.answer(request, batch, group, deadline, limit)


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await read_body(request)
    except BodyTimeout as exc:
        raise ApiError(408, f"{exc}: send the body at once, or faster", code="timeout") from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}"[:300]) \
            from None
    if not isinstance(body, dict):
        raise ApiError(400, "the JSON body must be an object")
    return body


def _api_error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


__all__ = ["ApiKey", "Gateway", "GatewayStats", "Usage"]
