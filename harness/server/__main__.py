"""`python -m harness.server MODEL ...`: the same as `harness serve MODEL ...` (what the launcher runs)."""

import sys

from harness.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
