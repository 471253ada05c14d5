"""``python -m hapd.ddp``: the DP-EV / DP-CP baselines (:mod:`hapd.harness.ddp`)."""

from hapd.harness.ddp import main
from hapd.util import exit_process

if __name__ == "__main__":
    exit_process(main())
