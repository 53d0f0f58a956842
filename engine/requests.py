"""The engine core's request bookkeeping, the same for every backend.

Admission (the prompt to token ids: text, ids, or a chat through the backend's template; a
resumed request's delivered ids appended), the backend's events turned into what the daemon
receives (TokenChunks as tokens come and a final GenerateResult, or one GenerateResult), stop
strings checked over the whole text (a resumed request's delivered text included: a stop string
may span the seam), aborts, usage and timing.

A chunk's ids and text always travel together: a token whose text is not complete yet (a partial
UTF-8 character) or that may begin a stop string is held back with the ones after it, so the ids
a client has received are exactly the text it has received (what `resume` relies on).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from engined.engine import protocol as proto
from engined.engine.backend import (
    Admission,
    Backend,
    Delta,
    Event,
    Finished,
    PromptLogprobs,
    RequestRejected,
)

MAX_PROMPT_TOKENS = 1 << 20


@dataclass
class _Active:
    msg: proto.GenerateRequest
    arrived_at: float
    prompt_tokens: int  # the original prompt (resumed ids excluded)
    resumed: int
    text: str  # the resumed text, then everything generated
    resume_len: int = 0  # characters of `text` that are the resumed text
    started_at: float | None = None
    batch_size: int = 0
    ids: list[int] = field(default_factory=list)  # generated here (not the resumed ones)
    sent_text: int = 0  # characters of `text` already delivered (starts after the resumed text)
    held_ids: list[int] = field(default_factory=list)  # generated, not yet delivered
    stopped: bool = False
    # with sampling.logprobs: one Position per id of `ids` / `held_ids`
    logprobs: list[proto.Position] | None = None
    held_logprobs: list[proto.Position] = field(default_factory=list)
    prompt: proto.PromptEcho | None = None  # echoed in the first message (then None)
    chat: Any = None  # a chat read by the backend's frontend (vLLM's parsers)

    @property
    def stops(self) -> list[str]:
        return self.msg.sampling.stop


class RequestTable:
    def __init__(self, backend: Backend, name: str, incarnation: int,
                 send: Callable[[proto.TokenChunk | proto.GenerateResult], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.name, self.incarnation = name, incarnation
        self.send = send
        self.clock = clock
        self.active: dict[str, _Active] = {}
        self.ok = 0
        self.failed = 0
        self.tokens = 0

    # --- admission ---------------------------------------------------------------------------
    def admit(self, msg: proto.GenerateRequest) -> None:
        now = self.clock()
        if msg.task != proto.TASK_GENERATE:
            self._task(msg)
            return
        if msg.id in self.active:
            self._reply(msg, error=f"request id {msg.id!r} is already running", rejected=True)
            return
        try:
            if msg.adapter is not None:
                self.backend.check_adapter(msg.adapter)
            chat = self._chat(msg)
            prompt_ids = chat.prompt_ids if chat is not None else self._prompt_ids(msg)
            sampling = msg.sampling
            remaining = sampling.max_tokens - len(msg.resume)
            if sampling.max_tokens < 1:
                raise RequestRejected("max_tokens must be at least 1")
            if remaining < 1:
                raise RequestRejected(f"resume carries {len(msg.resume)} tokens: nothing left "
                                      f"of max_tokens {sampling.max_tokens}")
            _check_sampling(sampling)
            resume_text = self.backend.detokenize(list(msg.resume)) if msg.resume else ""
            entry = _Active(msg, now, len(prompt_ids), len(msg.resume), resume_text,
                            resume_len=len(resume_text), sent_text=len(resume_text))
            if sampling.logprobs is not None:
                entry.logprobs = []
            entry.chat = chat
            if chat is not None and msg.resume:
                chat.replay(resume_text, list(msg.resume))
            if msg.resume:  # the prompt went back with the first engine's first message
                sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
            elif msg.echo or sampling.prompt_logprobs is not None:
                entry.prompt = proto.PromptEcho(prompt_ids, msg.prompt if (
                    msg.prompt and msg.prompt_ids is None and msg.messages is None)
                    else self.backend.detokenize(prompt_ids))
            self.backend.add(Admission(msg.id, prompt_ids + list(msg.resume), remaining,
                                       sampling, resumed=len(msg.resume), chat=chat,
                                       prompt_text=msg.prompt, adapter=msg.adapter))
        except RequestRejected as exc:
            self._reply(msg, error=str(exc), rejected=True)
            return
        self.active[msg.id] = entry

    def _chat(self, msg: proto.GenerateRequest) -> Any:
        return None if msg.chat is None else self.backend.open_chat(msg.chat)

    def _task(self, msg: proto.GenerateRequest) -> None:
        """A task answered at once (nothing is generated): tokenize, detokenize, or an
        adapter's load or unload."""
        if msg.task in (proto.TASK_LOAD_ADAPTER, proto.TASK_UNLOAD_ADAPTER):
            self._adapter_task(msg)
            return
        if msg.task in (proto.TASK_SLEEP, proto.TASK_WAKE_UP):
            self._reply(msg, **sleep_task(self.backend, self.name, msg))
            return
        try:
            if msg.adapter is not None:
                self.backend.check_adapter(msg.adapter)
            if msg.task == proto.TASK_DETOKENIZE:
                ids = list(msg.prompt_ids or [])
                self._reply(msg, text=self.backend.detokenize(ids), token_ids=ids,
                            finish_reason=proto.FINISH_STOP)
                return
            if msg.task != proto.TASK_TOKENIZE:
                raise RequestRejected(f"unknown task {msg.task!r}")
            ids = (self.backend.tokenize(msg.prompt, special=False)
                   if not msg.add_special_tokens and msg.prompt and msg.messages is None
                   else self._prompt_ids(msg))
            self._reply(msg, token_ids=ids, prompt_tokens=len(ids),
                        finish_reason=proto.FINISH_STOP,
                        token_strs=self.backend.vocab_pieces(ids) if msg.token_strs else None,
                        max_model_len=self.backend.max_model_len)
        except RequestRejected as exc:
            self._reply(msg, error=str(exc), rejected=True)
        except (ValueError, TypeError, IndexError, OverflowError, KeyError) as exc:
            self._reply(msg, error=f"cannot {msg.task} that: {type(exc).__name__}: {exc}",
                        rejected=True)

    def _adapter_task(self, msg: proto.GenerateRequest) -> None:
        """Load or unload a LoRA adapter (engine.adapters); the result lists what is loaded."""
        name = msg.adapter or ""
        try:
            if msg.task == proto.TASK_LOAD_ADAPTER:
                self.backend.load_adapter(name, msg.adapter_path)
            else:
                self.backend.unload_adapter(name)
        except RequestRejected as exc:
            self._reply(msg, error=str(exc), rejected=True)
            return
        except Exception as exc:  # noqa: BLE001 - the task failed; the engine serves on
            self._reply(msg, error=f"adapter {name!r}: {msg.task} failed: "
                                   f"{type(exc).__name__}: {exc}")
            return
        done = "loaded from " + msg.adapter_path if msg.task == proto.TASK_LOAD_ADAPTER \
            else "unloaded"
        print(f"[adapter] {self.name} {name} {done}", file=sys.stderr, flush=True)
        self._reply(msg, finish_reason=proto.FINISH_STOP, adapters=self.backend.adapters())

    def _prompt_ids(self, msg: proto.GenerateRequest) -> list[int]:
        if msg.messages is not None:
            if not msg.messages:
                raise RequestRejected("messages must not be empty")
            ids = self.backend.apply_chat_template(list(msg.messages))
        elif msg.prompt_ids is not None:
            ids = list(msg.prompt_ids)
        else:
            if not msg.prompt:
                raise RequestRejected("empty prompt")
            ids = self.backend.tokenize(msg.prompt)
        if len(ids) > MAX_PROMPT_TOKENS:
            raise RequestRejected(f"prompt of {len(ids)} tokens exceeds {MAX_PROMPT_TOKENS}")
        return ids

    def abort(self, request_id: str) -> None:
        """The daemon gave up on it (its client went away): nothing more is sent for it."""
        if self.active.pop(request_id, None) is not None:
            self.backend.abort(request_id)

    def started(self) -> None:
        """A step begins: the requests in it start their compute clock."""
        now, running = self.clock(), len(self.active)
        for entry in self.active.values():
            if entry.started_at is None:
                entry.started_at, entry.batch_size = now, running

    # --- events ------------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        entry = self.active.get(event.id)
        if entry is None or entry.stopped:
            return  # aborted, or already ended by a stop string
        if isinstance(event, Delta):
            self._on_delta(entry, event)
        elif isinstance(event, PromptLogprobs):
            if entry.prompt is not None:
                entry.prompt = msgspec.structs.replace(entry.prompt, logprobs=event.positions)
        elif isinstance(event, Finished):
            if event.reason == proto.FINISH_ERROR:
                self.active.pop(entry.msg.id, None)
                self._reply(entry.msg, error=event.error or "the engine failed this request",
                            rejected=event.rejected)
                self.failed += 1
                return
            self._finish(entry, event.reason, event.stop_reason)

    def _on_delta(self, entry: _Active, delta: Delta) -> None:
        """Per token of every running request: the common case (no stop strings, not
        streamed) is a few list and string appends."""
        self.tokens += len(delta.token_ids)
        entry.ids.extend(delta.token_ids)
        stream, stops = entry.msg.stream, entry.stops
        if stream:
            entry.held_ids.extend(delta.token_ids)
        if entry.logprobs is not None:
            positions = _positions(delta)
            (entry.held_logprobs if stream else entry.logprobs).extend(positions)
        if not stops:
            entry.text += delta.text
            if stream and delta.text:
                self._chunk(entry)
            return
        # from where a stop string could begin that ends in the new text (one may begin in the
        # resumed text: the seam)
        checked_from = max(0, len(entry.text) - _longest(stops) + 1)
        entry.text += delta.text
        found = _find_stop(entry.text, stops, checked_from)
        if found is not None:
            cut, stop = found
            kept = len(stop) if entry.msg.sampling.include_stop_str_in_output else 0
            entry.text = entry.text[:cut + kept]
            entry.stopped = True
            self.backend.abort(entry.msg.id)
            self._finish(entry, proto.FINISH_STOP, stop)
            return
        if stream and delta.text and not _may_begin_stop(entry.text, stops):
            self._chunk(entry)

    def _chunk(self, entry: _Active) -> None:
        text = entry.text[entry.sent_text:]
        delta = entry.chat.delta(text, entry.held_ids, False) if entry.chat else None
        self.send(proto.TokenChunk(entry.msg.id, self.name, self.incarnation, entry.held_ids,
                                   text, logprobs=self._held_logprobs(entry),
                                   prompt=entry.prompt, delta=delta))
        entry.held_ids, entry.sent_text, entry.prompt = [], len(entry.text), None

    @staticmethod
    def _held_logprobs(entry: _Active) -> list[proto.Position] | None:
        if entry.logprobs is None:
            return None
        held, entry.held_logprobs = entry.held_logprobs, []
        return held

    def _finish(self, entry: _Active, reason: str, stop_reason: int | str | None = None) -> None:
        self.active.pop(entry.msg.id, None)
        now = self.clock()
        started = entry.started_at if entry.started_at is not None else now
        stream = entry.msg.stream
        # streamed: what the chunks did not carry yet; else the whole generated text
        text = entry.text[entry.sent_text:] if stream else entry.text[entry.resume_len:]
        said: dict[str, Any] = {}
        if entry.chat is not None and stream:
            said = {"delta": entry.chat.delta(text, entry.held_ids, True),
                    "chat_finish": entry.chat.stream_finish(reason)}
        elif entry.chat is not None:
            message, finish = entry.chat.message(text, entry.ids, reason)
            said = {"message": message, "chat_finish": finish}
        self._reply(entry.msg, **said, text=text,
                    token_ids=entry.held_ids if stream else entry.ids,
                    logprobs=self._held_logprobs(entry) if stream else entry.logprobs,
                    prompt=entry.prompt, finish_reason=reason, stop_reason=stop_reason,
                    prompt_tokens=entry.prompt_tokens,
                    completion_tokens=entry.resumed + len(entry.ids),
                    batch_size=entry.batch_size, queue_s=started - entry.arrived_at,
                    compute_s=now - started)
        self.ok += 1

    def fail_all(self, error: str) -> None:
        """The engine is stopping: every request still here gets an error result."""
        for entry in list(self.active.values()):
            self.backend.abort(entry.msg.id)
            self._reply(entry.msg, error=error, finish_reason=proto.FINISH_ERROR)
            self.failed += 1
        self.active.clear()

    def _reply(self, msg: proto.GenerateRequest, **fields: object) -> None:
        if fields.get("error") is not None:
            fields.setdefault("finish_reason", proto.FINISH_ERROR)
        self.send(proto.GenerateResult(id=msg.id, engine=self.name,
                                       incarnation=self.incarnation, **fields))  # type: ignore


def sleep_task(backend: Backend, name: str, msg: proto.GenerateRequest) -> dict[str, Any]:
    """vLLM's sleep mode: sleep at msg.sleep_level, or wake up (the process stays); the
    result's fields."""
    try:
        if msg.task == proto.TASK_SLEEP:
            if msg.sleep_level not in (1, 2):
                raise RequestRejected(f"sleep level {msg.sleep_level} is not 1 or 2")
            backend.sleep(msg.sleep_level)
        else:
            backend.wake_up()
    except RequestRejected as exc:
        return {"error": str(exc), "rejected": True}
    except Exception as exc:  # noqa: BLE001 - the supervisor decides (it stops the engine)
        return {"error": f"{msg.task} failed: {type(exc).__name__}: {exc}"}
    done = f"asleep (level {msg.sleep_level})" if msg.task == proto.TASK_SLEEP else "awake"
    print(f"[sleep] {name} {done}", file=sys.stderr, flush=True)
    return {"finish_reason": proto.FINISH_STOP}


def _positions(delta: Delta) -> list[proto.Position]:
    """The delta's logprobs, one Position per id (a backend that gave none: empty ones)."""
    if delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids):
        return list(delta.logprobs)
    return [[] for _ in delta.token_ids]


def _longest(stops: list[str]) -> int:
    return max((len(s) for s in stops), default=0)


def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Where the earliest stop string begins in text[start:], and which one it is (the first
    listed, of those that begin there), or None."""
    found = [(i, s) for i, s in ((text.find(s, max(0, start)), s) for s in stops if s)
             if i >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def _may_begin_stop(text: str, stops: list[str]) -> bool:
    """Whether the end of `text` is a proper prefix of a stop string (hold it back: the next
    token may complete the stop)."""
    return any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))


def _check_sampling(s: proto.Sampling) -> None:
    """What no backend can do anything sensible with: RequestRejected naming the field."""
    checks = [
        (0 <= s.temperature <= 100, "temperature must be in [0, 100]"),
        (0 < s.top_p <= 1, "top_p must be in (0, 1]"),
        (s.top_k >= -1, "top_k must be 0 or -1 (off), or at least 1"),
        (0 <= s.min_p <= 1, "min_p must be in [0, 1]"),
        (0 < s.repetition_penalty <= 100, "repetition_penalty must be in (0, 100]"),
        (-2 <= s.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
        (-2 <= s.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
        (0 <= s.min_tokens <= s.max_tokens, "min_tokens must be in [0, max_tokens]"),
        (all(-100 <= b <= 100 for b in s.logit_bias.values()),
         "logit_bias values must be in [-100, 100]"),
        (all(t >= 0 for t in [*s.logit_bias, *s.stop_token_ids]),
         "token ids must be non-negative"),
        (all(k is None or 0 <= k <= proto.MAX_LOGPROBS
             for k in (s.logprobs, s.prompt_logprobs)),
         f"logprobs and prompt_logprobs must be in [0, {proto.MAX_LOGPROBS}]"),
    ]
    for ok, why in checks:
        if not ok:
            raise RequestRejected(why)
