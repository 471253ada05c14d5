"""A model's state on the ranks: what each rank holds, where its weights come from,
and checkpoints.

From the ground floor up:

- :mod:`~hapd.state.checkpoint_format` — the on-disk format of checkpoints: manifest and
  names;
- :mod:`~hapd.state.checkpoint_planners` — DCP's planners for uneven pieces (loaded only
  by a checkpoint's save or load);
- :mod:`~hapd.state.held` — what a rank holds of a model's state, as checkpoints see it
  (:class:`~hapd.state.held.HoldsPieces`);
- :mod:`~hapd.state.checkpoint` — :func:`hapd.save_checkpoint`,
  :func:`hapd.load_checkpoint`, safetensors export and import;
- :mod:`~hapd.state.weights` — where a rank's weights come from
  (:func:`~hapd.state.weights.weight_source`): an initializer, a safetensors file, a
  checkpoint, one piece at a time.
"""
