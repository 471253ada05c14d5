"""``python -m hapd.ddp``: the DP-EV / DP-CP baselines (:mod:`hapd.harness.ddp`)."""

from hapd.harness.ddp import main
from hapd.runtime.distributed import exit_rank

if __name__ == "__main__":
    exit_rank(main())
