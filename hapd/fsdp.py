"""``python -m hapd.fsdp``: the fully sharded data-parallel baseline (:mod:`hapd.harness.fsdp`)."""

from hapd.harness.fsdp import main
from hapd.util import exit_process

if __name__ == "__main__":
    exit_process(main())
