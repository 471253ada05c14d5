"""Running a plan: what happens on each rank.

The library, from the ground floor up: each module imports only those above it in this
list (and the rooms below the runtime: the compiler, the daemon's client, the profile
schema).

- :mod:`~hapd.runtime.layout` — the layout vocabulary: ``Identity``, ``Reduce``,
  ``Gather(d)`` and their checks;
- :mod:`~hapd.runtime.collectives` — uneven collectives between layouts, as autograd
  functions;
- :mod:`~hapd.runtime.distributed` — :func:`~hapd.runtime.distributed.init_distributed`:
  joining the job (the process group and this rank's device);
- :mod:`~hapd.runtime.in_place` — the runner of an elastic job's ranks: a rank whose
  peer went away parks and runs the script again in its process, in the next
  generation;
- :mod:`~hapd.runtime.gradsync` — :class:`~hapd.runtime.gradsync.GradSync`: summing
  replicated parameters' gradients over ranks during backward;
- :mod:`~hapd.runtime.recompute` — a plan's recompute spans run under activation
  checkpointing;
- :mod:`~hapd.runtime.stepwatch` — each rank's step check-ins, so that a collective
  that times out names the ranks out of step;
- :mod:`~hapd.runtime.counter_rng`, :mod:`~hapd.runtime.counter_kernels` (its Triton
  kernels: :mod:`~hapd.runtime.counter_triton`) and :mod:`~hapd.runtime.random_ops` —
  random ops drawn by hapd's counter-based generator, each rank its slice (one device:
  torch's own);
- :mod:`~hapd.runtime.rank` — the module one rank runs
  (:class:`~hapd.runtime.rank.RankModule`), the plan seen from that rank
  (:class:`~hapd.runtime.rank.RankView`) and its collectives
  (:class:`~hapd.runtime.rank.Communicate`);
- :mod:`~hapd.runtime.checkpoint_format` — the on-disk format of checkpoints: manifest and
  names;
- :mod:`~hapd.runtime.checkpoint_planners` — DCP's planners for uneven pieces (loaded
  only by a checkpoint's save or load);
- :mod:`~hapd.runtime.held` — what a rank holds of a model's state, as checkpoints see
  it (:class:`~hapd.runtime.held.HoldsPieces`);
- :mod:`~hapd.runtime.weights` — where a rank's weights come from
  (:func:`~hapd.runtime.weights.weight_source`): an initializer, a safetensors file, a
  checkpoint, one piece at a time;
- :mod:`~hapd.runtime.adapters` — :data:`~hapd.runtime.adapters.ADAPTERS`: the ops whose
  rule needs more than the local op, keyed on (op name, rule name);
- :mod:`~hapd.runtime.overlap` — one rank program run as two interleaved duplicas;
- :mod:`~hapd.runtime.rewrite` — :func:`distribute`: an exported program and a plan →
  the fx module one rank runs;
- :mod:`~hapd.runtime.pipeline` — pipeline execution: stages on groups of ranks, 1F1B
  over micro-batches;
- :mod:`~hapd.runtime.plan_source` — where a job's plan comes from
  (:func:`~hapd.runtime.plan_source.obtain_plan`: given, the daemon, or rank 0);
- :mod:`~hapd.runtime.programs` — a model's other programs (eval forward, other batch
  sizes): :class:`~hapd.runtime.programs.Recipe`,
  :func:`~hapd.runtime.programs.aligned_force`; the exports kept for a run of the
  script again in the same process (:class:`~hapd.runtime.programs.ExportCarry`);
- :mod:`~hapd.runtime.parallel_module` — :class:`~hapd.runtime.parallel_module.ParallelModule`,
  the module users train;
- :mod:`~hapd.runtime.parallelize` — :func:`hapd.parallelize`;
- :mod:`~hapd.runtime.checkpoint` — :func:`hapd.save_checkpoint`,
  :func:`hapd.load_checkpoint`, safetensors export and import;
- :mod:`~hapd.runtime.data` — :func:`hapd.loader` and the uneven samplers;
- :mod:`~hapd.runtime.mixed_length` — :func:`hapd.mixed_loader`: sequences of any
  length packed into rows from a pool of shapes, split over ranks by cost;
- :mod:`~hapd.runtime.elastic` — :class:`hapd.Elastic`: resuming an elastic job's next
  generation from in-memory snapshots kept on another host;
- :mod:`~hapd.runtime.check` — :func:`~hapd.runtime.check.check` (``hapd check``): one
  step of the 1-rank distributed program against eager ``program.module()``.

The benchmark worker and baselines built on the runtime live in :mod:`hapd.harness`,
which the runtime never imports.
"""
