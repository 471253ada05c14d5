"""Elastic jobs, rank side: what a rank does when hosts leave or join.

- :mod:`~hapd.elastic.in_place` — the runner of an elastic job's ranks: a rank whose
  peer went away parks and runs the script again in its process, in the next
  generation (the exports it keeps for that run are
  :class:`hapd.train.programs.ExportCarry`);
- :mod:`~hapd.elastic.park_events` — a rank's park events (asked to park, parked), one
  pair in the process whichever copy of the runner's module sets or reads them;
- :mod:`~hapd.elastic.resume` — :class:`hapd.Elastic`: resuming an elastic job's next
  generation from the survivors' memory, or from in-memory snapshots kept on another
  host;
- :mod:`~hapd.elastic.step_copy` — each rank's copies of its state at the last two
  steps it completed, and the survivors' agreement on the step to go on from;
- :mod:`~hapd.elastic.replica` — each rank's pieces that no other host holds, copied
  every step to a rank of the next host (a lost host's pieces of a split tensor come
  back from memory);
- :mod:`~hapd.elastic.moves` — which piece of which survivor's copy fills each piece of
  the new plan, and the point-to-point moves that do it;
- :mod:`~hapd.elastic.export_share` — the job's exported program, shared with the
  hosts that join it (they load it instead of exporting);
- :mod:`~hapd.elastic.standby` — a warm process a daemon keeps (torch, hapd and the
  model's library imported) until it is handed a rank of an elastic launch.

The launcher's side is :mod:`launcher.elastic`.
"""
