"""Supervision core: engined against the pidfd floor, supervisord and circus, in one run
(`python -m bench.core`; bench/README.md).

- `__main__`: the run, the tables, the summary of the targets and the method;
- `scenarios`: what is measured, every supervisor side by side;
- `observe`: how a kill is timed and seen (kernel proc events), the floor and its echo child;
- `peers`: supervisord and circus in their own venvs;
- `floor`: the floor itself, a ~40-line pidfd supervisor (`python -m bench.core.floor`).
"""
