"""A rank's park events under the in-place runner, in a module of their own.

The daemon starts the runner as ``python -m hapd.elastic.in_place``: that file then runs
as ``__main__``, a second copy of the module beside the ``hapd.elastic.in_place`` the
rest of hapd imports (the snapshot sender, the replicas). Events defined in it were two:
the runner's watcher set its own, and a rank waiting on a snapshot's send to a lost host
read the other, never saw the park request and waited past the launcher's hold. This
module is only ever imported, so its events are one in the process."""

from __future__ import annotations

import threading

PARK_REQUESTED = threading.Event()
"""Set when the daemon asked this rank's generation to park (cleared at each run of the
script): a rank waiting on something other than a collective — a snapshot's send to a
host that went silent (:class:`hapd.Elastic`) — stops waiting and raises
:class:`~hapd.errors.CollectiveError`, so it parks too."""
PARKED = threading.Event()
"""Set when this rank parked (cleared at each run of the script)."""

__all__ = ["PARKED", "PARK_REQUESTED"]
