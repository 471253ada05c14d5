"""``python -m hapd.fsdp``: the fully sharded data-parallel baseline (:mod:`hapd.harness.fsdp`)."""

import sys

from hapd.harness.fsdp import main

if __name__ == "__main__":
    sys.exit(main())
