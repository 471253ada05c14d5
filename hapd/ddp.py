"""``python -m hapd.ddp``: the DP-EV / DP-CP baselines (:mod:`hapd.runtime.ddp`)."""

import sys

from hapd.runtime.ddp import main

if __name__ == "__main__":
    sys.exit(main())
