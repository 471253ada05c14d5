"""Compiling a model into a plan: everything between a ``torch.export`` program and a
``.hplan`` file.

- :mod:`~hapd.compile.export` — a module and example inputs → a ``.pt2`` program;
- :mod:`~hapd.compile.normalize` — the functional form of an exported program (the one
  place it is made; the lowering and the runtime both read it);
- :mod:`~hapd.compile.lower` — a ``.pt2`` program → hapd's graph IR (``.hapg``) and its
  graph id (the IR itself lives in the Rust core);
- :mod:`~hapd.compile.summary` — what ``hapd inspect`` prints about a graph;
- :mod:`~hapd.compile.driver` — graph + profile → plan: the core's search alternating
  with the sharding-ratio LP, the DP-EV / DP-CP baselines, the plan document;
- :mod:`~hapd.compile.ratios` — the sharding-ratio LP and program costs;
- :mod:`~hapd.compile.replan` — an LP-only re-plan of a cached program for another
  profile;
- :mod:`~hapd.compile.plan` — the plan file (``.hplan``): load, save, explain.

This room imports torch (export and lowering need it); nothing here starts processes or
opens sockets.
"""
