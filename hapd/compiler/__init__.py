"""Graph IR + cluster profile → plan (``.hplan``): the search over sharding rules, the
sharding-ratio LP, overlap, recomputation, pipelines, and what a plan says of itself.

From the ground floor up (each module imports only those before it):

- :mod:`~hapd.compiler.options` — :class:`~hapd.compiler.options.CompileOptions`, validated,
  and their one conversion from a map of fields (no torch: the daemon reads them);
- :mod:`~hapd.compiler.choice` — which technique runs when several are priced: the
  simplest unless a more complex one is predicted faster by the margin;
- :mod:`~hapd.compiler.lengths` — integer lengths under sharding ratios (no pulp, no
  torch: the loaders read it);
- :mod:`~hapd.compiler.precision` — a graph's dtypes as autocast gives them (bf16/fp16
  pricing);
- :mod:`~hapd.compiler.lp` — what the sharding-ratio LPs share: rows under ratios, PuLP's
  variables and solver, memory caps, the result and the failure message;
- :mod:`~hapd.compiler.overlap` — two duplicas interleaved: the schedule's cost and its LP;
- :mod:`~hapd.compiler.sync_timeline` — how much of the gradient sync backward can hide:
  its buckets on the backward's timeline;
- :mod:`~hapd.compiler.ratios` — the sharding-ratio LP, program costs and memory;
- :mod:`~hapd.compiler.recompute` — the blocks activation recomputation can work on;
- :mod:`~hapd.compiler.search` — the SPMD search: the core's search alternating with the
  sharding-ratio LP, memory prices, recomputation, the DP-EV / DP-CP baselines;
- :mod:`~hapd.compiler.dp_gap` — why a plan is or is not faster than data parallelism;
- :mod:`~hapd.compiler.plan_summary` — the one-line summary of a plan document;
- :mod:`~hapd.compiler.techniques` — SPMD, pipelines and overlap priced against each other;
- :mod:`~hapd.compiler.plan` — the plan file (``.hplan``): load, save, explain;
- :mod:`~hapd.compiler.driver` — graph + profile → plan: the SPMD search, the plan
  document, the optional pipeline;
- :mod:`~hapd.compiler.replan` — an LP-only re-plan of a cached program for another
  profile;
- :mod:`hapd.compiler.pipeline` — pipeline stages: their cost model and search.

This room reads :mod:`hapd.ir` and :mod:`hapd.profile`; nothing here starts processes
or opens sockets.
"""
