"""``python -m hapd.worker``: hapd's training worker (:mod:`hapd.runtime.worker`)."""

import sys

from hapd.runtime.worker import main

if __name__ == "__main__":
    sys.exit(main())
