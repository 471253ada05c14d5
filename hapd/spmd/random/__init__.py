"""Random ops drawn by hapd's counter-based generator: every element's draw is a pure
function of (seed, op, index in the single-device tensor), so a rank draws exactly its
slice (one device: torch's own generator unless asked).

- :mod:`~hapd.spmd.random.counter_rng` — the generator in torch ops;
- :mod:`~hapd.spmd.random.counter_triton` — its Triton kernels;
- :mod:`~hapd.spmd.random.counter_kernels` — the fused draws (Triton on CUDA, torch ops
  elsewhere);
- :mod:`~hapd.spmd.random.attention_triton` — a flash attention's Triton kernels whose
  dropout is the counter's draw;
- :mod:`~hapd.spmd.random.attention_kernels` — that attention as one fused kernel with
  its backward (the mask drawn again, never stored), on CUDA;
- :mod:`~hapd.spmd.random.random_ops` — the random ops of a rank program, drawn by the
  counter.
"""
