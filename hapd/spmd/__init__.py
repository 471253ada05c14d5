"""One rank's program: an exported program and a plan → the fx module a rank runs,
with its collectives.

From the ground floor up (each module imports only those before it, and
:mod:`hapd.spmd.random`):

- :mod:`~hapd.spmd.script` — the runner of a user's script on a rank (torch-free): the
  script as ``python SCRIPT`` runs it, the process ended without finalization;
- :mod:`~hapd.spmd.group_sockets` — the process groups' connections, shut down at once
  when a rank leaves a broken group (no wait on work pending on a silent peer);
- :mod:`~hapd.spmd.collectives` — uneven collectives between layouts, as autograd
  functions;
- :mod:`~hapd.spmd.layout` — the layout vocabulary: ``Identity``, ``Reduce``,
  ``Gather(d)`` and their checks;
- :mod:`~hapd.spmd.gradsync` — :class:`~hapd.spmd.gradsync.GradSync`: summing
  replicated parameters' gradients over ranks during backward;
- :mod:`~hapd.spmd.rank` — the module one rank runs
  (:class:`~hapd.spmd.rank.RankModule`), the plan seen from that rank
  (:class:`~hapd.spmd.rank.RankView`) and its collectives
  (:class:`~hapd.spmd.rank.Communicate`);
- :mod:`~hapd.spmd.adapters` — :data:`~hapd.spmd.adapters.ADAPTERS`: the ops whose
  rule needs more than the local op, keyed on (op name, rule name);
- :mod:`~hapd.spmd.checkpointed` — a plan's recompute spans run under activation
  checkpointing;
- :mod:`~hapd.spmd.stepwatch` — each rank's step check-ins, so that a collective that
  times out names the ranks out of step;
- :mod:`~hapd.spmd.distributed` — :func:`~hapd.spmd.distributed.init_distributed`:
  joining the job (the process group and this rank's device);
- :mod:`~hapd.spmd.duplicas` — one rank program run as two interleaved duplicas (HiDup);
- :mod:`~hapd.spmd.rewrite` — :func:`~hapd.spmd.rewrite.distribute`: an exported program
  and a plan → the fx module one rank runs;
- :mod:`~hapd.spmd.pipeline` — pipeline execution: stages on groups of ranks, 1F1B over
  micro-batches;
- :mod:`hapd.spmd.random` — random ops drawn by hapd's counter-based generator, each
  rank its slice.
"""
