"""Cluster profiles: what a plan is costed against.

- :mod:`~hapd.profile.schema` — the profile document (devices, links, per-collective
  α/β), its validation on load and its profile id; importable without torch;
- :mod:`~hapd.profile.profiler` — ``hapd profile`` / ``python -m hapd.profiler``:
  measures FLOP/s and collectives on real ranks into a profile (torch is imported only
  by the measuring functions, so the launcher can use its options and assembly).
"""
