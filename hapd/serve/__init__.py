"""The daemon: drop folder, plan cache, rank jobs and leases, in-memory training
snapshots. What it says on the wire is :mod:`hapd.wire`.

- :mod:`~hapd.serve.events` — a job's output events, spilled to disk past a bound;
- :mod:`~hapd.serve.leftovers` — the ranks a daemon started and may have to end;
- :mod:`~hapd.serve.rank_guard` — the guard a rank runs under (ends with its daemon);
- :mod:`~hapd.serve.jobs` — this daemon's share of each job: its ranks, leases, output;
- :mod:`~hapd.serve.standby` — warm rank processes kept for elastic launches;
- :mod:`~hapd.serve.snapshots` — training snapshots kept for another host's ranks;
- :mod:`~hapd.serve.watch` — the drop folder's watcher;
- :mod:`~hapd.serve.guard` — limits on requests and folders;
- :mod:`~hapd.serve.cache` — the plan cache keyed by graph and cluster profile;
- :mod:`~hapd.serve.drops` — graphs dropped into the folder, compiled into plans;
- :mod:`~hapd.serve.daemon` — the daemon itself: its loop and dispatch.

Importable without torch (the launcher uses it); the daemon loads the compiler only
when it first compiles.
"""
