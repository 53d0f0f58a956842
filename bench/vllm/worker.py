"""bench.vllm's direct path: vLLM's LLMEngine driven in this one process, no engined around it.

    VLLM_PYTHON -m bench.vllm.worker CONFIG_JSON    # started by bench.vllm, never by hand

Runs under the vLLM interpreter with nothing of engined but its engine package, which bench.vllm
puts on PYTHONPATH as the daemon exposes it to its children, from the repository root; so this
file imports only the standard library and `engined.engine`. The engine is built by the very
function an engine child calls (`build_vllm_backend`, the same EngineConfig: EngineArgs, thread
bound, warm-up). Each job on stdin (one JSON line: prompts, max_tokens, concurrency, requests) is
run as a user of vLLM's own API runs it: `concurrency` requests added (tokenized, the
SamplingParams engined's backend builds: greedy, DELTA outputs), `step()` until none is
unfinished, a finished request replaced by the next before the next step (the best any server in
front of this engine could do), until `requests` have finished. One JSON line answers each job;
EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    answers = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: our JSON lines keep the real one
    os.dup2(2, 1)
    from engined.engine.protocol import EngineConfig
    from engined.engine.vllm_backend import build_vllm_backend

    backend = build_vllm_backend(EngineConfig(**json.loads(sys.argv[1])), lambda *_: None)
    try:
        print(json.dumps({"ready": True, "dtype": backend.dtype}), file=answers, flush=True)
        for n, line in enumerate(sys.stdin):
            print(json.dumps(run_job(backend.engine, backend.tokenizer, json.loads(line), n)),
                  file=answers, flush=True)
    finally:
        backend.close()
    return 0


def run_job(engine: Any, tokenizer: Any, job: dict[str, Any], job_no: int) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompts, total = job["prompts"], int(job["requests"])
    ids = [f"d{job_no}-{i}" for i in range(total)]
    tokens, sent, latency = dict.fromkeys(ids, 0), {}, {}
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, top_p=1.0,
                            output_kind=RequestOutputKind.DELTA)
    added = 0
    started = time.perf_counter()

    def add() -> None:
        nonlocal added
        sent[ids[added]] = time.perf_counter()
        prompt_ids = list(tokenizer.encode(prompts[added % len(prompts)]))
        engine.add_request(ids[added], TokensPrompt(prompt_token_ids=prompt_ids), params)
        added += 1

    while added < min(int(job["concurrency"]), total):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs:
                tokens[out.request_id] += len(out.outputs[0].token_ids)
            if out.finished:
                latency[out.request_id] = time.perf_counter() - sent[out.request_id]
                if added < total:
                    add()
    return {"elapsed_s": time.perf_counter() - started,
            "latencies_s": [latency.get(i) for i in ids], "tokens": [tokens[i] for i in ids]}


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 - vLLM's threads could keep a failed worker alive
        import traceback

        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)
