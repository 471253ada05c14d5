"""``python -m hapd.ddp``: the DP-EV / DP-CP baselines (:mod:`hapd.harness.ddp`)."""

import sys

from hapd.harness.ddp import main

if __name__ == "__main__":
    sys.exit(main())
