"""The light engine, `builtin:echo`: the same lifecycle, heartbeats and request loop as a real
engine, no torch: characters are tokens (a token id is the character's code point) and the
completion is the prompt itself, so it is an exact oracle: a request resumed after k delivered
tokens continues with the prompt's character k. A chat echoes its last message. Fault switches
for tests and chaos runs come from the child's environment (set through the spec's `env`):

* ENGINED_ECHO_LOAD_S=SECONDS  — take this long to "load" (reported as progress phases)
* ENGINED_ECHO_FAIL=build      — the build raises (a crash: exit 1, restarted with backoff)
* ENGINED_ECHO_FAIL=config     — the build reports an invalid config (exit 78, FAILED at once)
* ENGINED_ECHO_TOKEN_MS=MS     — time per generated token (one token per request per step;
  without it a step emits every remaining token at once)
* ENGINED_ECHO_CLOSE_S=SECONDS — take this long to free the "model" in the child's cleanup
* ENGINED_ECHO_SPAWN=child,setsid — start sleeping descendants at build and never stop them
  (`setsid`: one that leaves the engine's process group), as engines with workers do
* ENGINED_ECHO_TEMPFILE=1      — leave a file in the temporary directory at build, never removed
  (as vLLM's FileStore stays there after a kill)
* prompts `!stall`, `!raise`, `!grow` and `!wedge` inject faults (engine.faults wraps every
  echo engine's backend); for other models set ENGINED_FAULT_INJECTION=1 to enable them.

LoRA adapters, cheaply, so that the supervisor's adapter routing and replay can be tested without
vLLM: echo "loads" an adapter (EngineConfig.adapters, the load_adapter task) when its path is a
LoRA adapter directory (engine.adapters' checks: absolute, a directory, an adapter_config.json
of a LoRA with a rank; the same words as a vLLM engine's for one that is not) and reads nothing
else. A request with adapter NAME echoes "[NAME] " followed by the prompt: the prefix is output
like the rest (tokens, max_tokens and resume count it), so a test can tell which adapter
answered, and a resumed request continues it exactly.

vLLM's sleep mode, cheaply, for the supervisor's tests of sleep_mode level1/level2: the sleep task
marks echo asleep at that level (it frees nothing: it holds nothing) and it refuses requests,
naming the level, until the wake_up task.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable

from engined.engine.adapters import Adapters
from engined.engine.backend import (
    Admission,
    Backend,
    Delta,
    Emit,
    EngineConfigError,
    Finished,
    Load,
    ProgressFn,
    PromptLogprobs,
    RequestRejected,
    first_position,
    refuse_structured,
)
from engined.engine.protocol import Position, TokenLogprob

if TYPE_CHECKING:
    from engined.engine.protocol import ChatMessage, GpuMemory

MAX_ECHO_PROMPT = 1 << 20


class _Echo:
    def __init__(self, request: Admission, prompt: list[int], output: list[int],
                 start: int) -> None:
        self.id = request.id
        self.prompt = prompt  # the prompt's ids (without the resumed ones)
        self.source = output  # what it echoes: the prompt, after its adapter's "[name] "
        self.position = start  # next character to emit
        self.end = min(len(output), start + request.max_tokens)
        self.reason = "stop" if self.end == len(output) else "length"
        self.logprobs = request.sampling.logprobs
        self.prompt_logprobs = request.sampling.prompt_logprobs


def echo_position(token: int, top: int) -> Position:
    """The echo model is certain of its next character: logprob 0, rank 1; the `top` likeliest
    are it and the code points after it, at vLLM's floor for an impossible token (-9999)."""
    return [TokenLogprob(token, 0.0, 1, chr(token))] + [
        TokenLogprob(other, -9999.0, rank, chr(other))
        for rank, other in enumerate(range(token + 1, min(token + top, 0x110000)), start=2)]


class EchoBackend(Backend):
    device = "cpu"
    dtype = "none"
    kind = "builtin:echo"

    burst_window = False  # a step costs nothing: waiting for a burst would only add latency

    def __init__(self, token_s: float) -> None:
        self.token_s = token_s
        self.running: dict[str, _Echo] = {}
        self.loras = Adapters()
        self.asleep = 0  # the sleep level while asleep in place (module docstring)

    @classmethod
    def build(cls, progress: ProgressFn) -> EchoBackend:
        fail = os.environ.get("ENGINED_ECHO_FAIL", "")
        load_s = float(os.environ.get("ENGINED_ECHO_LOAD_S", "0"))
        progress("weights", "echo")
        if load_s > 0:
            _sleep_in_steps(load_s, progress)
        if fail == "build":
            raise RuntimeError("echo build failed (ENGINED_ECHO_FAIL=build)")
        if fail == "config":
            raise EngineConfigError("echo config rejected (ENGINED_ECHO_FAIL=config)")
        _spawn_descendants(os.environ.get("ENGINED_ECHO_SPAWN", ""))
        if os.environ.get("ENGINED_ECHO_TEMPFILE") == "1":
            import tempfile
            fd, _ = tempfile.mkstemp(prefix="echo_")
            os.close(fd)
        progress("warmup", "")
        return cls(float(os.environ.get("ENGINED_ECHO_TOKEN_MS", "0")) / 1000.0)

    # --- tokens ------------------------------------------------------------------------------
    max_model_len = MAX_ECHO_PROMPT

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def vocab_pieces(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if 0 <= i < 0x110000)

    def apply_chat_template(self, messages: list[ChatMessage]) -> list[int]:
        return self.tokenize(messages[-1].content if messages else "")

    # --- requests ----------------------------------------------------------------------------
    def add(self, request: Admission) -> None:
        if self.asleep:
            raise RequestRejected(f"the engine is asleep (sleep level {self.asleep}): wake it "
                                  f"up first")
        refuse_structured(request.sampling, "builtin:echo")
        if len(request.prompt_ids) > MAX_ECHO_PROMPT:
            raise RequestRejected(f"prompt of {len(request.prompt_ids)} tokens is longer than "
                                  f"{MAX_ECHO_PROMPT}")
        if any(not 0 <= i < 0x110000 for i in request.prompt_ids):
            raise RequestRejected("token ids of builtin:echo are unicode code points")
        resumed = request.resumed
        prompt = request.prompt_ids[:len(request.prompt_ids) - resumed] if resumed else \
            request.prompt_ids
        output = prompt
        if request.adapter is not None:
            output = self.tokenize(f"[{self.loras.get(request.adapter).name}] ") + prompt
        self.running[request.id] = _Echo(request, prompt, output, resumed)

    # --- adapters: names only (module docstring) ----------------------------------------------
    def adapters(self) -> list[str]:
        return self.loras.names()

    def load_adapter(self, name: str, path: str) -> None:
        adapter = self.loras.prepare(name, path)
        if adapter is not None:
            self.loras.add(adapter)

    def unload_adapter(self, name: str) -> None:
        self.loras.remove(name)

    def check_adapter(self, name: str) -> None:
        self.loras.get(name)

    # --- vLLM's sleep mode, mimicked (module docstring) ---------------------------------------
    def sleep(self, level: int) -> None:
        if self.running:
            raise RequestRejected(f"{len(self.running)} requests still run: drain it first")
        self.asleep = level

    def wake_up(self) -> None:
        self.asleep = 0

    def _prompt_logprobs(self, echo: _Echo, emit: Emit) -> None:
        top = echo.prompt_logprobs
        if top is not None:
            echo.prompt_logprobs = None
            first = echo.prompt[0]
            emit(PromptLogprobs(echo.id, [first_position(first, chr(first))] + [
                echo_position(t, top) for t in echo.prompt[1:]]))

    def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.running)

    def pending_tokens(self) -> int:
        return 1 if self.running else 0

    def step(self, emit: Emit, on_token: Callable[[], None]) -> None:
        if self.token_s:
            time.sleep(self.token_s)  # one token for every running request, like a batch step
        for echo in list(self.running.values()):
            upto = min(echo.end, echo.position + 1) if self.token_s else echo.end
            ids = echo.source[echo.position:upto]
            echo.position = upto
            self._prompt_logprobs(echo, emit)
            if ids:
                top = echo.logprobs
                emit(Delta(echo.id, ids, self.detokenize(ids), None if top is None else
                           [echo_position(t, top) for t in ids]))
            if echo.position >= echo.end and echo.id in self.running:
                del self.running[echo.id]
                emit(Finished(echo.id, echo.reason))
        on_token()

    def load(self) -> Load:
        return Load(running=len(self.running), waiting=0)

    def dummy_step(self) -> None:
        if self.token_s:
            time.sleep(self.token_s)

    def gpu_memory(self) -> list[GpuMemory]:
        return []

    def close(self) -> dict[str, float]:
        time.sleep(float(os.environ.get("ENGINED_ECHO_CLOSE_S", "0")))
        self.running.clear()
        return {"model_freed": 1.0}


def _spawn_descendants(kinds: str) -> None:
    """Sleeping processes the engine starts and never stops (for the no-leftovers tests)."""
    import subprocess
    import sys

    started = []
    for kind in filter(None, (k.strip() for k in kinds.split(","))):
        if kind not in ("child", "setsid"):
            raise EngineConfigError(f"ENGINED_ECHO_SPAWN: unknown kind {kind!r}")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                start_new_session=kind == "setsid", stdin=subprocess.DEVNULL)
        started.append(f"{proc.pid} ({kind})")
    if started:
        print(f"[echo] started descendants: {', '.join(started)}", file=sys.stderr, flush=True)


def _sleep_in_steps(total_s: float, progress: ProgressFn) -> None:
    """Load slowly but stay responsive to SIGTERM (progress raises StopRequested)."""
    deadline = time.monotonic() + total_s
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
        progress("weights", f"{max(left, 0):.2f}s left")
