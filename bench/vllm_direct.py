"""bench.vllm's direct path: vLLM's LLMEngine driven in this one process, no engined around it.

    VLLM_PYTHON -m bench.vllm_direct CONFIG_JSON    # started by bench/vllm.py, never by hand

Runs under the vLLM venv's interpreter with nothing of engined but its engine package, which
bench/vllm.py puts on PYTHONPATH exactly as the daemon exposes it to its children
(`engined.supervisor.launcher.expose_engine_package`), and from the repository root, as the
daemon runs its children; so this file imports only the standard library and `engined.engine`.
The engine is built by the very function an engine child calls (`build_vllm_backend`, same
EngineConfig: EngineArgs, thread bound, environment, warm-up); then each job on stdin (one JSON
line: prompts, max_tokens) is timed as a user of vLLM's own API runs it: tokenize, `add_request`
every prompt at once (the same SamplingParams engined's backend builds: greedy, DELTA outputs),
`step()` until none is unfinished. A job with `requests` and `concurrency` is sustained load
instead: `concurrency` requests in flight, a finished one replaced by the next before the next
`step()` (the best any server in front of this engine could do), until `requests` have
finished. One JSON line answers each job; EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    # vLLM logs to stdout: keep the real stdout for our JSON lines, send fd 1 to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from engined.engine.protocol import EngineConfig
    from engined.engine.vllm_backend import build_vllm_backend

    config = EngineConfig(**json.loads(sys.argv[1]))
    backend = build_vllm_backend(config, lambda phase, detail: None)
    engine, tokenizer = backend.engine, backend.tokenizer

    from vllm import __version__

    print(json.dumps({"ready": True, "dtype": backend.dtype, "device": backend.device,
                      "vllm": __version__}), file=answers, flush=True)
    for job_no, line in enumerate(sys.stdin, 1):
        answer = run_job(engine, tokenizer, json.loads(line), job_no)
        print(json.dumps(answer), file=answers, flush=True)
    backend.close()
    return 0


def run_job(engine: Any, tokenizer: Any, job: dict[str, Any], job_no: int) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts, max_tokens = job["prompts"], job["max_tokens"]
    total = int(job.get("requests", len(prompts)))
    in_flight = int(job.get("concurrency", len(prompts)))
    ids = [f"d{job_no}-{i}" for i in range(total)]
    tokens = dict.fromkeys(ids, 0)
    sent: dict[str, float] = {}
    latency: dict[str, float] = {}
    finish: dict[str, str] = {}
    # what VllmBackend.add builds for a greedy request of the core
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None,
                            output_kind=RequestOutputKind.DELTA)
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
