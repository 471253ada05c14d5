"""``python -m hapd.profiler``: the cluster profiler (:mod:`hapd.profile.profiler`)."""

from hapd.profile.profiler import main
from hapd.runtime.distributed import exit_rank

if __name__ == "__main__":
    exit_rank(main())
