"""Recovery and upgrade gaps (`python -m bench.recovery`; bench/README.md): an engine's crash →
READY and → first token under the exec launcher and the fork server, the memory forked engines
share, warm standby promotion against the kernel's teardown floor, and `enginectl upgrade`
against a daemon restart and a crash, under load.

- `__main__`: the run, the summary of the targets;
- `daemon`: the two backends (tiny-llama, vLLM), the daemon with its launcher pinned;
- `measure`: one kill, one promotion, the teardown floor, one memory reading;
- `tables`: the report of sections 1-3 and the summary;
- `upgrade`: section 4, the load, the three ways to replace a daemon, its report.
"""
