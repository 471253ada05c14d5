"""``python -m hapd.worker``: hapd's training worker (:mod:`hapd.harness.worker`)."""

from hapd.harness.worker import main
from hapd.runtime.distributed import exit_rank

if __name__ == "__main__":
    exit_rank(main())
