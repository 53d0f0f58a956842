"""engined's benchmarks (`python -m bench.NAME`, from the repository root; see bench/README.md).

The daemon driver is the tests' own, `tests/driver.py`, and it has one import name everywhere:
`driver`. pytest imports it so (it puts `tests/` on sys.path, by the rootdir conftest); for the
benchmarks this package puts `tests/` on sys.path once, here, before any of its modules is
imported. Appended, not prepended: nothing in `tests/` (its `vllm/` folder, say) may shadow an
installed package. Never import it as `tests.driver`: that would load a second copy of it.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
