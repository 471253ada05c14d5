"""Cluster profiles as data: what a plan is costed against. Never imports torch.

- :mod:`~hapd.profile.schema` — the profile document (devices, links, per-collective
  α/β), its validation on load and its profile id;
- :mod:`~hapd.profile.options` — :class:`ProfilerOptions` and ``--sizes`` parsing;
- :mod:`~hapd.profile.precision` — each device's matmul rate per dtype (stated or from its
  datasheet) and what ``precision="auto"`` picks;
- :mod:`~hapd.profile.fit` — fitting ``time = α + bytes/β``;
- :mod:`~hapd.profile.assemble` — measurements into a profile, and its summary.

Measuring a cluster is :mod:`hapd.profiler`.
"""
