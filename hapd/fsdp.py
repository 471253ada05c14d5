"""``python -m hapd.fsdp``: the fully sharded data-parallel baseline (:mod:`hapd.runtime.fsdp`)."""

import sys

from hapd.runtime.fsdp import main

if __name__ == "__main__":
    sys.exit(main())
