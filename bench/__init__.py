"""engined's benchmarks (`python -m bench.NAME`, from the repository root; see bench/README.md).

They drive engined with the tests' own harness, the `testkit` package beside this one (a real
daemon, its control socket, clean-up by pid): run from the repository root, both are importable.
"""
