"""supervisor.scratch on its own: where an incarnation's TMPDIR is, and when there is none."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engined.supervisor.host import scratch


@pytest.fixture
def tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    base = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    yield base
    scratch.remove_root(1234)
    for cache in base.glob("torchinductor_*"):  # made for the incarnations' links
        cache.rmdir()
    base.rmdir()


def test_an_incarnation_dir_is_named_after_it_and_made_on_demand(tmp: Path):
    env = scratch.environment("1234/vllm-0/3", {"FOO": "1"})
    path = tmp / "engined-scratch-1234" / "vllm-0.3"
    assert env["TMPDIR"] == str(path) and path.is_dir()
    assert (path.stat().st_mode & 0o777) == 0o700
    cache = env["TORCHINDUCTOR_CACHE_DIR"]
    assert cache.startswith(str(tmp / "torchinductor_"))
    # what torch keeps under $TMPDIR whatever the variable says (its precompiled headers)
    # lands in the same cache, which outlives the incarnation
    link = path / os.path.basename(cache)
    assert link.is_symlink() and link.resolve() == Path(cache).resolve() and link.is_dir()
    (path / "vllm_dist_x").write_text("")
    assert scratch.remove("1234/vllm-0/3") == 1 and not path.exists()
    assert Path(cache).is_dir()
    assert scratch.remove("1234/vllm-0/3") == 0  # gone already: nothing to do


def test_a_long_name_gets_a_short_unique_dir_that_fits_a_socket_path(tmp: Path):
    long = "a" * 60
    first = scratch.incarnation_dir(f"1234/{long}-0/1")
    second = scratch.incarnation_dir(f"1234/{long}-1/1")
    assert first != second and first.parent == second.parent == tmp / "engined-scratch-1234"
    assert len(str(first)) <= 64 and len(str(first / ("0" * 36))) < 108  # + a uuid4


def test_a_tmpdir_or_cache_of_the_spec_or_the_daemon_is_kept(tmp: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    assert scratch.environment("1234/web-0/1", {"TMPDIR": "/srv/tmp"}) == {}
    env = scratch.environment("1234/web-0/2", {"TORCHINDUCTOR_CACHE_DIR": "/srv/cache"})
    assert set(env) == {"TMPDIR"}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/daemon-cache")  # the child inherits it
    assert set(scratch.environment("1234/web-0/3", {})) == {"TMPDIR"}
    assert not (tmp / "engined-scratch-1234" / "web-0.1").exists()
