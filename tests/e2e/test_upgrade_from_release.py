"""An upgrade in place across the wave-4 layout: engined as released at 28027b8 (its wheel, in a
venv of its own), serving a fleet; the wheel of this tree installed over it; `enginectl upgrade`.
The same daemon pid runs the new code, every engine is kept (same pids, same start times,
restarts and history), requests through the gateway never fail, and the new code supervises
the adopted engines as its own (a kill is a restart)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import psutil
import pytest

from testkit.driver import REPO_ROOT, free_port
from testkit.handover import Clients, identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
RELEASE = "28027b8"  # main before wave 4's layout (issue 44)
FLEET = [{"name": "echo", "replicas": 2, "model": "builtin:echo",
          "env": {"ENGINED_ECHO_TOKEN_MS": "5"}},
         {"name": "ex", "model": "builtin:echo", "launcher": "exec"}]


def _run(*argv: str | Path, cwd: Path | None = None, timeout_s: float = 300) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def _wheel(source: Path, out: Path) -> Path:
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         source, "-w", out)
    (wheel,) = out.glob("engined-*.whl")
    return wheel


@pytest.fixture(scope="module")
def release_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a venv with the released engined installed, the wheel of this tree): the venv takes
    engined's dependencies from this interpreter's site-packages (a path, not a site dir:
    this tree's editable install is not seen there)."""
    root = tmp_path_factory.mktemp("release")
    known = subprocess.run(["git", "cat-file", "-e", f"{RELEASE}^{{commit}}"], cwd=REPO_ROOT,
                           capture_output=True)
    assert known.returncode == 0, (f"commit {RELEASE} is not in this clone's history: fetch "
                                   f"the history (`git fetch --unshallow`)")
    old = root / "old"
    old.mkdir()
    archive = subprocess.run(["git", "archive", RELEASE], cwd=REPO_ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    old_wheel = _wheel(old, root / "old-wheel")
    new_wheel = _wheel(REPO_ROOT, root / "new-wheel")
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", "--no-deps", old_wheel)
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(purelib.strip(), "engined-deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n")
    return python, new_wheel


def test_an_upgrade_from_the_release_before_the_new_layout_keeps_every_engine(
        engined, release_venv):
    python, new_wheel = release_venv
    gateway = free_port()
    d = engined(FLEET, ready=False, supervisor={"gateway": f"127.0.0.1:{gateway}"})
    assert d.stop() == 0  # started by this tree's code: start it again as the release
    d.python = str(python)
    d.start()
    d.wait_all_ready()
    package = Path(_run(python, "-c", "import engined.supervisor as m; print(m.__file__)")
                   .strip()).parent
    assert (package / "replica.py").is_file() and not (package / "lifecycle").exists()
    before = identity(d)
    daemon_pid = d.pid
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", new_wheel)
    # what the same pid will exec: only the new layout is installed now
    assert (package / "lifecycle" / "replica.py").is_file()
    assert not (package / "replica.py").exists()
    with Clients(gateway, threads=4) as clients:
        d.wait_for(lambda: clients.ok >= 8, 30, "requests flowing")
        done = d.ctl("upgrade")
        assert done.returncode == 0, (done.stdout, done.stderr)
        ok_at_upgrade = clients.ok
        d.wait_for(lambda: clients.ok >= ok_at_upgrade + 8, 30, "requests after the upgrade")
    assert clients.errors == [], clients.errors[:5]
    status = d.status()["supervisor"]
    assert status["pid"] == daemon_pid and status["handovers"] == 1, status
    assert identity(d) == before  # same processes (pid, start time), same counts
    for name in ("echo-0", "ex-0"):  # the new code supervises them: a kill is a restart
        victim = d.engine(name)["pid"]
        psutil.Process(victim).kill()
        now = d.wait_restarted(name, victim)
        assert now["restarts"] == before[name][3] + 1, now

