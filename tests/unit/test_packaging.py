"""engined installs under one `engined` namespace, so it can share an environment with
supervisord (whose import package is `supervisor`; vLLM pulls supervisord in). .ci/run installs
supervisord into its wheel tier's venv and sets ENGINED_REQUIRE_SUPERVISORD=1; elsewhere that
check runs where supervisord happens to be installed.

Each check runs in a fresh interpreter outside the source tree: from the repository root the
source folders `supervisor/` and `engine/` are importable as such, which an installation is not.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def _supervisord_installed(cwd: Path) -> bool:
    found = _python("import importlib.util as u; print(u.find_spec('supervisor') is not None)", cwd)
    return found.stdout.strip() == "True"


def test_engined_owns_no_generic_top_level_package(tmp_path: Path) -> None:
    done = _python("import importlib.util as u, engined.supervisor.daemon, engined.engine.core\n"
                   "s = u.find_spec('supervisor')\n"
                   "print(u.find_spec('engine'), 'engined' in ((s and s.origin) or ''))", tmp_path)
    assert (done.returncode, done.stdout.split()) == (0, ["None", "False"]), done


def test_supervisord_and_engined_work_in_one_environment(tmp_path: Path) -> None:
    if not _supervisord_installed(tmp_path):
        if os.environ.get("ENGINED_REQUIRE_SUPERVISORD") == "1":
            pytest.fail("ENGINED_REQUIRE_SUPERVISORD=1 but supervisord is not installed")
        pytest.skip("supervisord is not installed here")
    supervisord = shutil.which("supervisord", path=str(Path(sys.executable).parent))
    assert supervisord, "supervisord's console script is missing"
    done = subprocess.run([supervisord, "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip()[:1].isdigit(), done
    done = _python("import supervisor.supervisord, engined.supervisor.daemon; print('ok')",
                   tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done
    done = subprocess.run([sys.executable, "-m", "engined.supervisor.daemon", "--check", "-c",
                           str(REPO_ROOT / "etc" / "fleet.yaml")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "replica(s)" in done.stdout, done


def test_every_package_folder_is_listed_for_installation() -> None:
    """A subpackage left out of pyproject's list installs without its files: an editable
    install hides that, a wheel does not."""
    import tomllib

    tool = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    sources = {src: name for name, src in tool["package-dir"].items()}
    found = set()
    for src, name in sources.items():
        for init in sorted((REPO_ROOT / src).rglob("__init__.py")):
            relative = init.parent.relative_to(REPO_ROOT / src).parts
            found.add(".".join((name, *relative)))
    assert found == set(tool["packages"])
