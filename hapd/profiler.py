"""``python -m hapd.profiler``: the cluster profiler (:mod:`hapd.profile.profiler`)."""

from hapd.profile.profiler import main
from hapd.util import exit_process

if __name__ == "__main__":
    exit_process(main())
