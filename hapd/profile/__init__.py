"""Cluster profiles: what a plan is costed against.

- :mod:`~hapd.profile.schema` — the profile document (devices, links, per-collective
  α/β), its validation on load and its profile id; importable without torch;
- :mod:`~hapd.profile.profiler` — ``hapd profile`` / ``python -m hapd.profiler``: the
  driver and CLI (starts the ranks, loads the measuring code only when it runs);
- :mod:`~hapd.profile.options` — :class:`ProfilerOptions` and ``--sizes`` parsing (no torch);
- :mod:`~hapd.profile.measure` — what every rank measures: FLOP/s, memory, collective
  times (torch is imported only inside its functions);
- :mod:`~hapd.profile.fit` — fitting ``time = α + bytes/β`` (no torch);
- :mod:`~hapd.profile.assemble` — measurements into a profile, and its summary (no torch);
- :mod:`~hapd.profile.rank` — the rank program of ``python -m launcher profile``.
"""
