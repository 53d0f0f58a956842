"""What a container needs of engined (Kubernetes collects only the main process's output, and
restarts a pod only when its main process exits): `supervisor.engine_logs: stdout` puts every
engine line on engined's stdout, prefixed with its engine, instead of a file; and
`supervisor.exit_on_failed` turns an engine parked FAILED into engined stopping everything and
exiting 1, so the kubelet's own backoff takes over instead of a silently degraded pod."""

from __future__ import annotations

import re

import pytest
import yaml

BAD = {"name": "bad", "model": "builtin:echo", "env": {"ENGINED_ECHO_FAIL": "config"}}

@pytest.mark.smoke
def test_engine_output_on_stdout_and_a_failed_engine_ends_engined(engined):
    d = engined([{"name": "good", "model": "builtin:echo"}],
                supervisor={"engine_logs": "stdout", "exit_on_failed": True})
    assert d.ctl("logs", "good-0").stdout.strip()  # enginectl logs still has them (the ring)
    spec = yaml.safe_load(d.spec_path.read_text())
    spec["engines"].append(BAD)  # an engine that exits 78 (a config error): FAILED at once
    d.spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    d.expect_unclean_exit = True
    d.ctl("reload")
    code = d.wait_exit(120)
    assert code == 1, code
    out = d.stderr_text()  # the driver gives engined's stdout and stderr one file
    assert re.search(r"\[shutdown\] bad-0 is FAILED \(.*config.*\) and "
                     r"supervisor.exit_on_failed is set", out), out[-3000:]
    # each engine's own lines, on engined's stdout, with its name in front
    assert re.search(r"^bad-0 \| .*echo config rejected \(ENGINED_ECHO_FAIL=config\)", out,
                     re.M), out[-3000:]
    assert re.search(r"^good-0 \| \[ready\] good-0 incarnation 1 ", out, re.M), out[-3000:]
    assert not list(d.log_dir.glob("*-0.log"))  # no engine log file written


def test_without_exit_on_failed_a_failed_engine_leaves_engined_serving(engined):
    d = engined([{"name": "good", "model": "builtin:echo"}, BAD], ready=False)
    d.wait_state("bad-0", "FAILED", 60)
    d.wait_state("good-0", "READY", 60)
    d.holds(d.alive, 1.0, "engined serving on, the default")
    assert (d.log_dir / "good-0.log").is_file()
