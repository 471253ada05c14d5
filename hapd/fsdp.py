"""``python -m hapd.fsdp``: the fully sharded data-parallel baseline (:mod:`hapd.harness.fsdp`)."""

from hapd.harness.fsdp import main
from hapd.runtime.distributed import exit_rank

if __name__ == "__main__":
    exit_rank(main())
