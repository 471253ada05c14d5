"""Pipelines over host groups (HSPMD): pricing and searching stage splits.

- :mod:`~hapd.compiler.pipeline.repeats` — a deep graph with its repeated blocks
  dropped, for pricing pipeline stages;
- :mod:`~hapd.compiler.pipeline.stage_cost` — the pipeline cost model: units, unit costs
  and memory, links, the 1F1B schedule (``docs/pipelines.md``);
- :mod:`~hapd.compiler.pipeline.stage_search` — the pipeline search: the stage table, the
  DP over cuts and groups of hosts, the pipeline plan;
- :mod:`~hapd.compiler.pipeline.stages` — cutting an exported program into the stage
  programs.
"""
