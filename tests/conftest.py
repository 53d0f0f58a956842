"""Shared fixtures; the daemon driver itself is testkit/driver.py (the benchmarks use it too).

`engined(...)` starts a real daemon per test and, at teardown, stops it, requires a clean exit and
fails the test if any engine process it ever spawned is still alive (killing such leftovers by
pid).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.driver import (
    ORPHAN_GRACE_S,
    PYTHON,
    REPO_ROOT,
    Daemon,
    _clean_env,
    build_spec,
    wait_engines_gone,
)

SEED_ENV = "ENGINED_TEST_SEED"
TESTS = Path(__file__).resolve().parent
# The end-to-end folders (a real daemon, driven as a user would): a test there is the `e2e`
# tier, run by .ci/run, unless it is one of the default run's smoke tests (`smoke`: one or a few
# per feature) or belongs to a tier of its own.
E2E_FOLDERS = ("e2e", "chaos", "fuzz")
OWN_TIERS = ("smoke", "slow", "soak", "bench", "vllm", "gpu")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (item.path.relative_to(TESTS).parts[0] in E2E_FOLDERS
                and not any(item.get_closest_marker(tier) for tier in OWN_TIERS)):
            item.add_marker(pytest.mark.e2e)


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def rng_seed() -> int:
    """The seed of every random choice a test makes: $ENGINED_TEST_SEED, else a fresh one. It is
    printed (pytest shows it with a failure's captured output): set it to replay that run."""
    value = os.environ.get(SEED_ENV)
    seed = int(value) if value else random.SystemRandom().randrange(1 << 32)
    print(f"[seed] {SEED_ENV}={seed}{'' if value else ' (fresh; set it to replay this run)'}")
    return seed


@pytest.fixture
def rng(rng_seed: int) -> random.Random:
    """A random.Random seeded with `rng_seed` (printed; $ENGINED_TEST_SEED replays it)."""
    return random.Random(rng_seed)



@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory with a short path (ZeroMQ ipc:// paths are limited to ~100 chars)."""
    root = Path(tempfile.mkdtemp(prefix="eg", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _daemons(root: Path) -> Iterator[Callable[..., Daemon]]:
    """A factory of real daemons under `root`; on the way out each is stopped (a clean exit
    required) and no engine process it ever spawned may outlive it (leftovers are killed by
    pid and fail the test)."""
    daemons: list[Daemon] = []

    def start(engines: list[dict[str, Any]] | None = None,
              supervisor: dict[str, Any] | None = None,
              defaults: dict[str, Any] | None = None, ready: bool = True,
              env: dict[str, str | None] | None = None) -> Daemon:
        home = root / f"d{len(daemons)}"
        home.mkdir()
        daemon = Daemon(home, build_spec(home, engines, supervisor, defaults), env)
        daemons.append(daemon)
        daemon.start()
        if ready:
            daemon.wait_all_ready()
        return daemon

    yield start
    problems = [problem for daemon in daemons for problem in _stop_and_check(daemon)]
    assert not problems, "; ".join(problems)


def _stop_and_check(daemon: Daemon) -> list[str]:
    problems = []
    try:
        if daemon.alive():
            daemon.spawned_pids()  # note the pids while the daemon can still say
            with contextlib.suppress(Exception):
                daemon.status()
        was_running = daemon.alive()
        code = daemon.stop()
        if was_running and code != 0 and not daemon.expect_unclean_exit:
            problems.append(f"engined pid {daemon.pid} did not exit cleanly on SIGTERM "
                            f"(exit {code})")
        if daemon.proc is not None:
            alive = wait_engines_gone(daemon.spawned_pids() | daemon.server_pids, daemon.pid,
                                      ORPHAN_GRACE_S)
            for pid in alive:
                with contextlib.suppress(Exception):
                    os.kill(pid, signal.SIGKILL)
            if alive:
                problems.append(f"engine processes outlived engined pid {daemon.pid}: {alive}")
    finally:
        daemon.dump()
    return problems


@pytest.fixture
def engined(short_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: engined(engines=[...], supervisor={...}, defaults={...}, ready=True, env={...})
    -> Daemon (`env`: changes to the daemon's environment, as `Daemon` takes them)."""
    with _daemons(short_tmp) as start:
        yield start


@pytest.fixture(scope="module")
def module_engined() -> Iterator[Callable[..., Daemon]]:
    """`engined`'s factory for a daemon that a module's read-only tests share (built by a
    module-scoped fixture of that module; its tests carry one `xdist_group`, so that they run
    in one worker, which starts the daemon once)."""
    root = Path(tempfile.mkdtemp(prefix="em", dir="/tmp"))
    try:
        with _daemons(root) as start:
            yield start
    finally:
        shutil.rmtree(root, ignore_errors=True)



@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A session-wide ENGINED_CACHE_DIR with the tiny-llama checkpoint built once, up front, and
    shared by the session's pytest-xdist workers (the first builds it, under a lock)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent  # the workers' base directories are siblings in it
    cache = root / "engined-cache"
    with open(root / "engined-cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not any(cache.glob("tiny-llama-*/config.json")):
            _build_tiny_llama(cache)
    return cache


def _build_tiny_llama(cache: Path) -> None:
    env = {**_clean_env(), "ENGINED_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [PYTHON, "-c", "from engined.engine.checkpoint import tiny_llama_dir; "
                       "print(tiny_llama_dir(lambda phase, detail: None))"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "config.json").is_file(), done.stdout


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_cache: Path) -> Path:
    """The built checkpoint directory: a valid `{path: DIR}` model."""
    (path,) = tiny_cache.glob("tiny-llama-*")
    return path


@pytest.fixture(scope="session")
def engine_only_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter of its own venv that has what the engine side needs (pyzmq, msgspec) and
    nothing else: no torch, no transformers, no engined (the daemon exposes its engine package
    to it). Built without pip: the two packages are linked from this venv."""
    import site
    import sys
    import sysconfig

    root = tmp_path_factory.mktemp("engine-only-venv")
    done = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = Path(subprocess.run(
        [str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
         "['purelib'])"], capture_output=True, text=True, timeout=60, check=True).stdout.strip())
    for name in ("zmq", "pyzmq.libs", "msgspec"):
        if (ours / name).exists():
            (theirs / name).symlink_to(ours / name, target_is_directory=True)
    probe = subprocess.run([str(root / "bin" / "python"), "-c",
                            "import zmq, msgspec\ntry:\n import torch\nexcept ImportError:\n"
                            " print('ok')"], capture_output=True, text=True, timeout=60,
                           cwd=root)
    assert probe.stdout.strip() == "ok", (probe.stdout, probe.stderr, site.getsitepackages())
    return root / "bin" / "python"
