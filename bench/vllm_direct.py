"""bench.vllm's direct path: vLLM's LLMEngine driven in this one process, no engined around it.

    VLLM_PYTHON -m bench.vllm_direct CONFIG_JSON    # started by bench.vllm, never by hand

Runs under the vLLM venv's interpreter with nothing of engined but its engine package, which
bench.vllm puts on PYTHONPATH exactly as the daemon exposes it to its children
(`engined.supervisor.host.launcher.expose_engine_package`), and from the repository root, as the
daemon runs its children; so this file imports only the standard library and `engined.engine`.
The engine is built by the very function an engine child calls (`build_vllm_backend`, same
EngineConfig: EngineArgs, thread bound, environment, warm-up); then each job on stdin (one JSON
line: prompts, max_tokens) is timed as a user of vLLM's own API runs it: tokenize, `add_request`
every prompt at once (the same SamplingParams engined's backend builds: greedy, DELTA outputs),
`step()` until none is unfinished. A job with `requests` and `concurrency` is sustained load
instead: `concurrency` requests in flight, a finished one replaced by the next before the next
`step()` (the best any server in front of this engine could do), until `requests` have
finished. One JSON line answers each job; EOF on stdin ends it.

Beside the jobs, the same engine serves the bench's `floor` path: `POST /v1/generate` ({prompt,
max_tokens}, answered with the text, token count and finish reason) on a loopback port (the ready
line's `floor_port`), by the smallest HTTP server one could put in front of this LLMEngine:
aiohttp in this same process, the engine stepped by a task of the same event loop, a future per
request and nothing else (no supervisor, no second process, no ZeroMQ, no streaming, no
bookkeeping). Engined against it is what engined itself costs; it against direct is what any HTTP
server costs. The jobs and the floor's requests take turns (the bench runs one path at a time).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from typing import Any

# Before a step, this many turns of the event loop: the first reads the sockets that became
# readable during the last step, the second runs aiohttp's handler tasks for what they carried,
# which add their requests to the engine; the third is the stepper's own. So a request that
# arrived during step k joins step k+1, as engined's child admits everything on its socket
# before each step.
_FLOOR_YIELDS = 3


def main() -> int:
    # vLLM logs to stdout: keep the real stdout for our JSON lines, send fd 1 to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from engined.engine.protocol import EngineConfig
    from engined.engine.vllm_backend import build_vllm_backend

    config = EngineConfig(**json.loads(sys.argv[1]))
    backend = build_vllm_backend(config, lambda phase, detail: None)
    engine, tokenizer = backend.engine, backend.tokenizer

    try:
        asyncio.run(serve(engine, tokenizer, {"ready": True, "dtype": backend.dtype,
                                              "device": backend.device}, answers))
    finally:
        backend.close()
    return 0


async def serve(engine: Any, tokenizer: Any, ready: dict[str, Any], answers: Any) -> None:
    """The floor's HTTP server, and the stdin jobs (run in the loop: nothing else runs then)."""
    from aiohttp import web
    from vllm import __version__

    loop = asyncio.get_running_loop()
    floor = Floor(engine, tokenizer)
    app = web.Application()
    app.router.add_post("/v1/generate", floor.generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    await web.SockSite(runner, listener).start()
    stepper = asyncio.create_task(floor.run())
    print(json.dumps({**ready, "vllm": __version__, "floor_port": listener.getsockname()[1]}),
          file=answers, flush=True)

    jobs: asyncio.Queue[str | None] = asyncio.Queue()

    def read_jobs() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(jobs.put_nowait, line)
        loop.call_soon_threadsafe(jobs.put_nowait, None)  # EOF: the bench is done

    threading.Thread(target=read_jobs, name="jobs", daemon=True).start()
    job_no = 0
    while (line := await jobs.get()) is not None:
        job_no += 1
        answer = run_job(engine, tokenizer, json.loads(line), job_no)
        print(json.dumps(answer), file=answers, flush=True)
    stepper.cancel()
    await runner.cleanup()


class _Waiting:
    __slots__ = ("done", "pieces", "tokens")

    def __init__(self, done: asyncio.Future[str]) -> None:
        self.done, self.pieces, self.tokens = done, [], 0


class Floor:
    """`POST /v1/generate` straight into this process's LLMEngine (see the module's doc)."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        from vllm import TokensPrompt

        self.engine, self.tokenizer = engine, tokenizer
        self.tokens_prompt = TokensPrompt
        self.waiting: dict[str, _Waiting] = {}
        self.work = asyncio.Event()
        self.n = 0

    async def generate(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.n += 1
        request_id = f"floor-{self.n}"
        params = greedy(int(body["max_tokens"]))
        entry = self.waiting[request_id] = _Waiting(asyncio.get_running_loop().create_future())
        prompt_ids = list(self.tokenizer.encode(body["prompt"]))
        self.engine.add_request(request_id, self.tokens_prompt(prompt_token_ids=prompt_ids),
                                params)
        self.work.set()
        try:
            finish = await entry.done
        except asyncio.CancelledError:  # the client went away
            if self.waiting.pop(request_id, None) is not None:
                self.engine.abort_request([request_id])
            raise
        return web.json_response({"text": "".join(entry.pieces),
                                  "completion_tokens": entry.tokens, "finish_reason": finish})

    async def run(self) -> None:
        """The stepper: while the engine has work, a few loop turns (new requests join), a step."""
        while True:
            await self.work.wait()
            self.work.clear()
            while self.engine.has_unfinished_requests():
                for _ in range(_FLOOR_YIELDS):
                    await asyncio.sleep(0)
                for out in self.engine.step():
                    entry = self.waiting.get(out.request_id)
                    if entry is None:
                        continue  # aborted
                    completion = out.outputs[0] if out.outputs else None
                    if completion is not None:
                        entry.pieces.append(completion.text)
                        entry.tokens += len(completion.token_ids)
                    if out.finished:
                        del self.waiting[out.request_id]
                        entry.done.set_result(str(getattr(completion, "finish_reason", None)))


def greedy(max_tokens: int) -> Any:
    """What VllmBackend.add builds for a greedy request of the core (DELTA outputs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None,
                          output_kind=RequestOutputKind.DELTA)


def run_job(engine: Any, tokenizer: Any, job: dict[str, Any], job_no: int) -> dict[str, Any]:
    from vllm import TokensPrompt

    prompts, max_tokens = job["prompts"], job["max_tokens"]
    total = int(job.get("requests", len(prompts)))
    in_flight = int(job.get("concurrency", len(prompts)))
    ids = [f"d{job_no}-{i}" for i in range(total)]
    tokens = dict.fromkeys(ids, 0)
    sent: dict[str, float] = {}
    latency: dict[str, float] = {}
    finish: dict[str, str] = {}
    params = greedy(max_tokens)
    added = steps = 0
    started = time.perf_counter()

    def add() -> None:
        nonlocal added
        request_id = ids[added]
        sent[request_id] = time.perf_counter()
        prompt_ids = list(tokenizer.encode(prompts[added % len(prompts)]))
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt_ids), params)
        added += 1

    while added < min(in_flight, total):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0] if out.outputs else None
            if completion is not None:
                tokens[out.request_id] += len(completion.token_ids)
            if out.finished:
                latency[out.request_id] = time.perf_counter() - sent[out.request_id]
                finish[out.request_id] = str(getattr(completion, "finish_reason", None))
                if added < total:
                    add()
        steps += 1
    elapsed = time.perf_counter() - started
    return {"elapsed_s": elapsed, "latencies_s": [latency.get(i) for i in ids],
            "tokens": [tokens[i] for i in ids], "finish": [finish.get(i) for i in ids],
            "steps": steps}


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - vLLM's threads could keep a failed worker alive
        import traceback

        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)
