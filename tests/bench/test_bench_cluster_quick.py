"""The cluster gateway benchmark runs once, in its quick mode, so that it cannot rot.

`python -m bench.cluster --quick` in a subprocess (three nodes and a cluster gateway in network
namespaces; under a minute): it must exit 0, write every table with every row, and leave
nothing running. Nothing here asserts wall-clock speed; only what is not a timing: under a node
SIGKILLed and another node's link cut, no request failed and every answer is the oracle's.
Without network namespaces it skips, except under CI=true, where .ci/run provides them.
"""

from __future__ import annotations

import os

import pytest

from testkit.benchreport import run_quick, section, sections, tables
from testkit.clusternet import netns_problem

pytestmark = [pytest.mark.bench, pytest.mark.timeout(900)]
TIMEOUT_S = 600  # a bound, not a timing assertion


def test_cluster_quick_produces_every_table(tmp_path) -> None:
    why = netns_problem()
    if why is not None:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(why)
    text = run_quick("cluster", tmp_path / "cluster.md", TIMEOUT_S, printed=True)
    secs = sections(text)
    (hop,) = tables(section(secs, "1. The extra hop"))
    labels = [row[0] for row in hop]
    for what in ("time to first token", "time to last token"):
        for path in ("a node's gateway directly", "through the cluster gateway"):
            assert f"{what}, {path}" in labels, labels
    assert all(row[-1] == "12" for row in hop), hop

    counts, waits = tables(section(secs, "2. Faults under load"))
    count = {row[0]: row[1] for row in counts}
    assert count["requests"] == count["identical to the oracle"] == "60", counts
    assert count["failed"] == count["answered with other text"] == "0", counts
    assert int(count["moved to another node (engined_gateway_migrations_total)"]) >= 1, counts
    assert [row[0] for row in waits] == ["a node SIGKILLed (daemon and engines)",
                                         "a node's link cut (silence)"], waits
