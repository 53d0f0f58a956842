"""enginectl's entry point before wave 4 (an old console script, `python -m
engined.supervisor.cli`): enginectl lives in engined.supervisor.ctl now."""

import sys

from engined.supervisor.ctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
