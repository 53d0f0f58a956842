"""`python -m engined.engine`: the exec entry of an engine-core child (config in ENGINED_CONFIG)."""

import os
import sys

from engined.engine.contract import ENV_CONFIG
from engined.engine.core import EngineCoreProc

if __name__ == "__main__":
    if ENV_CONFIG not in os.environ:
        sys.exit(f"engine: {ENV_CONFIG} is not set; engines are started by engined")
    EngineCoreProc.run_engine_core(os.environ[ENV_CONFIG])
