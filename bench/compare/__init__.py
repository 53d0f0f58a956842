"""engined against supervisord, circus and the pidfd floor, side by side in one run.

    python -m bench.compare            # full run (~10 min), writes bench/results/compare.md
    python -m bench.compare --quick    # n=5, 10 s idle, n=2 LLM crashes (~3 min)

Scenarios (see bench/README.md): 1 respawn latency (+ engined's kill → READY), 2 detection
latency, 3 idle overhead at 100 children, 4 control latency with 100 children, 5 tiny-llama
crash → READY against the cold-start floor, 6 /metrics scrape with 100 engines; then a summary of
the issue's targets. Peers run from their own venvs (bench/peers.py); every process started here is
tracked by pid and stopped by pid, never by name; everything listens on loopback or unix sockets.

The modules, by question:
- `__main__`: the run (options, the peers' venvs, the scenarios in order, the report);
- `labels`: the supervisors compared, as the rows name them;
- `latency`: scenarios 1 and 2, respawn and detection latency side by side (and kill → READY);
- `fleet`: scenarios 3, 4 and 6 at 100 children: idle overhead, control latency, scrapes;
- `cold_start`: scenario 5, tiny-llama crash → READY against the cold-start floor;
- `summary`: the summary of the targets and the method.
"""
