"""``python -m hapd.profiler``: the cluster profiler (:mod:`hapd.profiler.driver`)."""

from hapd.profiler.driver import main
from hapd.util import exit_process

if __name__ == "__main__":
    exit_process(main())
