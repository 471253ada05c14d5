"""``python -m hapd.worker``: hapd's training worker (:mod:`hapd.harness.worker`)."""

import sys

from hapd.harness.worker import main

if __name__ == "__main__":
    sys.exit(main())
