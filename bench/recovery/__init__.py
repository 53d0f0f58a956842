"""Recovery and upgrade gaps (`python -m bench.recovery`; bench/README.md): an engine's crash →
READY and → first token under the exec launcher and the fork server, the memory forked engines
share, warm standby promotion against the kernel's teardown floor, `enginectl upgrade` against a
daemon restart and a crash, under load, and engines on demand: a sleeping model's wake by kind of
engine, and a swap within a memory budget under load against an always-resident fleet.

- `__main__`: the run, the summary of the targets;
- `daemon`: the two backends (tiny-llama, vLLM), the daemon with its launcher pinned, the daemon
  behind its gateway;
- `measure`: one kill, one promotion, the teardown floor, one memory reading;
- `tables`: the report of sections 1-3 and the summary;
- `load`: the gateway's clients (sections 4-6);
- `upgrade`: section 4, the three ways to replace a daemon, its report;
- `ondemand`: sections 5-6, a wake by kind and a swap under load, their report.
"""
