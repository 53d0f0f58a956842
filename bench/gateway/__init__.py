"""Gateway benchmark: what the OpenAI-compatible gateway costs, and what it saves when engines die.

    python -m bench.gateway [--quick] [--out FILE]   # default bench/results/gateway.md,
                                                      # --quick: bench/results/gateway-quick.md

1. Overhead against talking to the engine directly, at 1 and 8 concurrent requests, for
   `builtin:tiny-llama` (transformers, real compute) and `builtin:echo` (no compute: pure
   overhead). Paths, in alternating order: direct (a client in this process speaking the engine's
   own request protocol over ZeroMQ: `supervisor/ipc.py`'s EngineChannels, the daemon's own
   code, bound in a scratch directory, with an engine child started as engined starts one; see
   the method notes for why it cannot be the daemon's child itself), streamed and not; the
   control socket's `POST /v1/generate`, streamed (NDJSON) and not; the gateway's
   `/v1/completions`, streamed (SSE) and not, over plain aiohttp and through the official
   `openai` client. Requests/s, latency p50/p95, overhead vs direct.
2. Time to first token of the streamed paths against direct streaming, p50/p95.
3. Requests lost per engine kill: two echo replicas (20 ms per token), 32 concurrent requests,
   one replica SIGKILLed while they run; through the gateway (it moves them) and through the
   control socket (no failover).
4. The daemon's event-loop lag (`engined_event_loop_lag_seconds`, GET /metrics) idle and with
   16 and 64 concurrent SSE streams through the gateway.

Prints markdown tables and writes them to --out. Every process is tracked and stopped by pid.

The modules, by question:
- `__main__`: the run (options, the two daemons' scenarios in order, the summary and the method);
- `paths`: the eight paths a request takes (direct over ZeroMQ, the control socket, the gateway
  with aiohttp and with `openai`), the direct engine channels and the daemon;
- `overhead`: scenarios 1 and 2, the gateway's cost and time to first token;
- `failover`: scenario 3, requests lost per engine kill;
- `lag`: scenario 4, the daemon's event-loop lag under streaming load.
"""
