"""`python -m engined.engine`: the exec entry of an engine-core child (config in ENGINED_CONFIG).

The engine side needs pyzmq and msgspec in the child's interpreter (its own venv under `python:`
included; vLLM brings both): without them it exits 78 saying so, never a crash loop.
"""

import os
import sys

from engined.engine.contract import CONFIG_LINE_PREFIX, ENV_CONFIG, EXIT_CONFIG

if __name__ == "__main__":
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # nothing but stdio from whoever spawned us
    if ENV_CONFIG not in os.environ:
        sys.exit(f"engine: {ENV_CONFIG} is not set; engines are started by engined")
    try:
        from engined.engine.core import EngineCoreProc
    except ImportError as exc:
        print(f"{CONFIG_LINE_PREFIX}the engine side needs pyzmq and msgspec in {sys.executable}, "
              f"but {exc.name or exc!r} cannot be imported ({exc}): {sys.executable} -m pip "
              f"install pyzmq msgspec", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    EngineCoreProc.run_engine_core(os.environ[ENV_CONFIG])
