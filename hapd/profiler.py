"""``python -m hapd.profiler``: the cluster profiler (:mod:`hapd.profile.profiler`)."""

import sys

from hapd.profile.profiler import main

if __name__ == "__main__":
    sys.exit(main())
