"""Fast recovery: engines forked from a preloaded fork server against engines started by exec.

    python -m bench.recovery [--quick] [--out FILE] [-n KILLS] [--vllm-python PATH]
                                       # default bench/results/recovery.md,
                                       # --quick: bench/results/recovery-quick.md

For tiny-llama (`builtin:tiny-llama`, transformers) and for the vLLM backend (`backend: vllm`
under its own interpreter), two daemons run side by side that differ only in the engines'
`launcher:` (exec | forkserver), each with one group of 2 replicas:

1. Crash → READY: SIGKILL of replica 0's engine → READY again with a higher incarnation (the
   daemon's own `since`, and when a 20 ms status poll saw it), and → the first token served: a
   `POST /v1/generate` (max_tokens 1, to that replica by name) sent over the control socket right
   after the kill and resent every 10 ms while it answers 503. Kills alternate between the two
   daemons (exec first on even rounds, forkserver first on odd ones), so load hits both alike.
2. Memory: RSS, USS and PSS (psutil `memory_full_info`) of every engine and of the fork server,
   after each replica has served a request: forked engines share the preloaded stack with the
   server and with each other copy-on-write.
3. Startup: daemon start → both replicas READY, each replica's `startup_s` (spawn → READY) at
   first start and after a kill, the fork server's own preload (`import_s`).
4. Warm standby promotion, in a third daemon per backend (1 serving replica, `standby: 1`,
   forkserver): SIGKILL of the serving replica → READY under its name (the standby's engine
   promoted) and → its first token, → a new standby READY; with a floor: the kernel's teardown
   of a bare process that maps as much memory as the victim did (SIGKILL → its pidfd readable).
   Only where the spec has a `standby` key (otherwise the row says it is not built yet).

A summary table holds the targets: tiny-llama through the fork server READY again ≤ 0.25 s
(median), the vLLM backend through the fork server ≤ 40 % of exec's crash → READY, and warm
standby promotion ≤ 20 ms.

The vLLM interpreter: --vllm-python, else $ENGINED_VLLM_PYTHON, else <repo>/.venv-vllm/bin/python
(a worktree without its own: set ENGINED_VLLM_PYTHON); without one the vLLM part is skipped and
the report says so. Every process is tracked and stopped by pid (SIGTERM,
wait, SIGKILL); nothing is killed by name. Nothing here asserts wall-clock speed.

The modules, by question:
- `__main__`: the run (options, the vLLM interpreter, the two backends in turn, the report);
- `daemon`: the two backends, the daemon with its launcher pinned, `POST /v1/generate`;
- `crash`: section 1, crash → READY and → first token;
- `memory`: section 2, RSS/USS/PSS of the engines and the fork server;
- `standby`: section 4, warm standby promotion and the kernel's teardown floor;
- `run`: one backend under both launchers (its starts are section 3);
- `tables`: the report, a table per section and the summary of the targets.
"""
