"""``python -m hapd.worker``: hapd's training worker (:mod:`hapd.harness.worker`)."""

from hapd.harness.worker import main
from hapd.util import exit_process

if __name__ == "__main__":
    exit_process(main())
