"""From ``torch.export`` to hapd's graph IR (``.hapg``): the front end of the compiler.

From the ground floor up (each module imports only those before it):

- :mod:`~hapd.ir.experts` — transformers' default mixture-of-experts layers traced
  as one op, ``hapd::routed_experts``, with the same values;
- :mod:`~hapd.ir.tied` — tied parameters, several names for one tensor;
- :mod:`~hapd.ir.fake` — tracing a model or program without weights (on the meta
  device) as if it had them;
- :mod:`~hapd.ir.op_facts` — the facts about ops the Python side keeps;
- :mod:`~hapd.ir.normalize` — the functional form of an exported program (the one
  place it is made; the lowering and the rank programs both read it);
- :mod:`~hapd.ir.flops` — an op's forward FLOPs, by torch's FLOP counter;
- :mod:`~hapd.ir.shapes` — one export for every batch: the symbolic batch dimension and
  the concrete program at any batch cut from it;
- :mod:`~hapd.ir.saved` — the activations the backward pass keeps;
- :mod:`~hapd.ir.lower` — a ``.pt2`` program → hapd's graph IR (``.hapg``) and its
  graph id (the IR itself lives in the Rust core);
- :mod:`~hapd.ir.derive` — a symbolic program's graph at any batch, derived from the
  graphs lowered at two batches when every size is linear in the batch;
- :mod:`~hapd.ir.kept` — the graphs a compile prices, lowered once at export and kept
  in the ``.pt2``;
- :mod:`~hapd.ir.export` — a module and example inputs → a ``.pt2`` program;
- :mod:`~hapd.ir.summary` — what ``hapd inspect`` prints about a graph.

This room imports torch and the Rust core; it knows nothing of profiles, plans or ranks.
"""
