"""`python -m engine`: the exec entry of an engine-core child. The config comes in ENGINED_CONFIG."""

import os
import sys

from engine.core import EngineCoreProc
from engine.protocol import ENV_CONFIG

if __name__ == "__main__":
    if ENV_CONFIG not in os.environ:
        sys.exit(f"engine: {ENV_CONFIG} is not set; engines are started by engined")
    EngineCoreProc.run_engine_core(os.environ[ENV_CONFIG])
