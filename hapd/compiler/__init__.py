"""Compiling a model into a plan: everything between a ``torch.export`` program and a
``.hplan`` file.

- :mod:`~hapd.compiler.export` — a module and example inputs → a ``.pt2`` program;
- :mod:`~hapd.compiler.fake` — tracing a model or program without weights (on the meta
  device) as if it had them;
- :mod:`~hapd.compiler.normalize` — the functional form of an exported program (the one
  place it is made; the lowering and the runtime both read it);
- :mod:`~hapd.compiler.lower` — a ``.pt2`` program → hapd's graph IR (``.hapg``) and its
  graph id (the IR itself lives in the Rust core);
- :mod:`~hapd.compiler.flops` — an op's forward FLOPs, by torch's FLOP counter;
- :mod:`~hapd.compiler.saved` — the activations the backward pass keeps;
- :mod:`~hapd.compiler.tied` — tied parameters, several names for one tensor;
- :mod:`~hapd.compiler.summary` — what ``hapd inspect`` prints about a graph;
- :mod:`~hapd.compiler.options` — :class:`~hapd.compiler.options.CompileOptions`, validated,
  and their one conversion from a map of fields;
- :mod:`~hapd.compiler.lp` — what the sharding-ratio LPs share: rows under ratios, PuLP's
  variables and solver, memory caps, the result and the failure message;
- :mod:`~hapd.compiler.ratios` — the sharding-ratio LP, program costs and memory, integer
  lengths;
- :mod:`~hapd.compiler.overlap` — two duplicas interleaved: the schedule's cost and its LP;
- :mod:`~hapd.compiler.recompute` — the blocks activation recomputation can work on;
- :mod:`~hapd.compiler.search` — the SPMD search: the core's search alternating with the
  sharding-ratio LP, memory prices, recomputation, the DP-EV / DP-CP baselines;
- :mod:`~hapd.compiler.repeats` — a deep graph with its repeated blocks dropped, for
  pricing pipeline stages;
- :mod:`~hapd.compiler.pipeline_cost` — the pipeline cost model: units, unit costs and
  memory, links, the 1F1B schedule (``docs/pipelines.md``);
- :mod:`~hapd.compiler.pipeline_search` — the pipeline search: the stage table, the DP
  over cuts and groups of hosts, the pipeline plan;
- :mod:`~hapd.compiler.stages` — cutting an exported program into pipeline stage programs;
- :mod:`~hapd.compiler.plan` — the plan file (``.hplan``): load, save, explain;
- :mod:`~hapd.compiler.driver` — graph + profile → plan: the SPMD search, the plan
  document, the optional pipeline;
- :mod:`~hapd.compiler.replan` — an LP-only re-plan of a cached program for another
  profile.

This room imports torch (export and lowering need it; :mod:`~hapd.compiler.options`
does not, so the daemon's room reads options without it); nothing here starts
processes or opens sockets.
"""
