"""What the daemon, the launcher and the ranks agree on besides the messages: the shape
of a job id, the bounds of a lease, and the variable a daemon sets in a rank's
environment. Torch-free, like the rest of :mod:`hapd.wire`."""

from __future__ import annotations

import re

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A job id: what a launch may name its job (it names a folder on every host)."""
MIN_LEASE_S = 1.0
"""Shortest lease a launch may ask for (several of the launcher's polls fit in it)."""
MAX_LEASE_S = 7 * 86400.0
"""Longest lease a launch may ask for."""
STARTED_ENV = "HAPD_STARTED_AT"
"""When the daemon started the rank's process (``time.time()``), in the rank's
environment: an elastic restart's time splits there (the launch, then the script up to
:func:`hapd.parallelize`)."""
PARK_FD_ENV = "HAPD_PARK_FD"
"""In an in-place job's ranks (:mod:`hapd.elastic.in_place`): the file descriptor of a
pipe from the daemon. A ``park`` request writes ``GENERATION\\n`` to it; a rank of that
generation shuts its process groups' connections down at once, so the collective it
waits in on a host that went silent fails and it parks (instead of waiting for the
collective timeout)."""
RUN_ENV = "HAPD_ELASTIC_RUN"
"""The elastic run's id (the same in every generation); unset: not an elastic launch."""
REPLICA_ENV = "HAPD_REPLICA"
"""``0`` turns an elastic run's replicas of the pieces no other host holds off
(:mod:`hapd.elastic.replica`; a lost rank's pieces then come from the snapshot)."""
