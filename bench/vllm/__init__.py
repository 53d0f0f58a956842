"""vLLM benchmark: vLLM under engined against vLLM on its own, in one run.

    python -m bench.vllm [--quick] [--out FILE]   # default bench/results/vllm.md,
                                                   # --quick: bench/results/vllm-quick.md
    python -m bench.vllm --only serving --out bench/results/vllm-serving.md   # section 5 alone

1. Serving overhead: one `backend: vllm` replica (vLLM's LLMEngine in-process in the engine
   child, builtin:tiny-llama, 1 thread) at 1 and 8 concurrent requests, max_tokens 16 and 64,
   greedy, through the control socket's `POST /v1/generate` and through the OpenAI gateway's
   `/v1/completions` (plain HTTP), against the same LLMEngine driven directly in one process
   (bench/vllm_direct.py: built by the engine child's own `build_vllm_backend`, then
   `add_request` + `step()`), against the floor (that same LLMEngine, in that process, behind
   the smallest HTTP server one could write for it: what any server costs, so that engined
   against it is what engined itself adds), and against the peer: `vllm serve` (its OpenAI
   server over the same model and engine arguments). Bursts (1 or 8 requests sent at once, the
   round timed to the last answer; paths alternate round by round): requests/s, tokens/s,
   latency p50/p95, overhead, and the fixed cost per request and per token fitted from the two
   max_tokens values. Sustained load (1b: 1 or 8 requests always in flight, each client
   sending its next request when its last one is answered; the direct worker replaces a
   finished request before its next step): throughput and latency per path.
2. Crash → READY: SIGKILL of the engine child, started by exec (`launcher: exec`, pinned: a cold
   interpreter per restart; engined's default, the fork server, is measured against exec by
   bench.recovery) → READY again (the daemon's own `since`) against a cold start of `vllm
   serve` (`python -m vllm.entrypoints.openai.api_server`, same model and engine arguments) from
   process start to `/health` 200, as an outer supervisor would restart it; also how long that
   server takes to exit after its EngineCore is SIGKILLed (what an outer supervisor waits for
   before it can restart anything).
3. A frozen engine core: SIGSTOP of the engine child with a streamed request in flight → the
   daemon declares it hung (`last_exit`), kills and restarts it, and the request (through the
   gateway) finishes on the replacement; against `vllm serve` with its EngineCore SIGSTOPped
   mid-request: `/health` polled for a bounded window.

4. `vllm serve` under engined, as a command engine: SIGKILL of its EngineCore or its API server
   → READY again, against a bare cold start; SIGSTOP of either → engined's verdict (stall or
   hang), against vLLM's own `/health` and a Kubernetes-style liveness probe on a bare server.
5. Serving: vLLM's own serving benchmark (`vllm.benchmarks.serve`: random prompts, 128 tokens in
   and 128 out with `--ignore-eos`, greedy, 8 and 32 requests in flight; quick: 32 tokens) against
   three servers of the same model, all up at once and measured in every order over rounds:
   `vllm serve` alone, engined's gateway in front of a `backend: vllm` engine (the same engine
   arguments, max_num_seqs 32), and engined's gateway in front of the same `vllm serve` as a
   command engine. vLLM's figures from its result JSON (requests/s, output tokens/s, TTFT median
   and p99, TPOT, ITL, failed requests and their errors), CPU time per request by process group,
   and the issue's target per concurrency and engined path: throughput at least `vllm serve`'s,
   median TTFT no worse (paired ratios, median over rounds).

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(as the vLLM test tier finds it). Prints markdown tables and writes them to --out. Every
process is tracked and stopped by pid (SIGTERM, wait, SIGKILL); nothing is killed by name.

The modules, by question (this file imports none of them: bench.recovery takes `engine` alone):
- `__main__`: the run (options, the order of the sections, the summary of the targets);
- `engine`: the engine under test, the vLLM interpreter, the environments, the daemon;
- `server`: `vllm serve` on its own, and the HTTP the sections speak to a server;
- `overhead`, `overhead_report`: sections 1-1d, engined's cost against direct and the floor;
- `failover`: sections 2 and 3, an engine that dies or freezes, measured and reported;
- `served`, `served_report`: section 4, `vllm serve` under engined;
- `serving`, `serving_report`: section 5, vLLM's serving benchmark through the gateway.
"""
