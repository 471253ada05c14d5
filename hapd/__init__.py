"""hapd: automatic SPMD training for PyTorch on heterogeneous GPU clusters.

Heavy entry points (they import torch) load on first use, so light modules such as
``hapd.errors`` and ``hapd.wire.client`` stay cheap to import.
"""

from __future__ import annotations

import importlib
from typing import Any

from hapd.errors import HapdError

__version__ = "0.3.0"

# public name -> module that defines it
_LAZY = {
    "export": "hapd.ir.export",
    "lower": "hapd.ir.lower",
    "GraphIR": "hapd.ir.lower",
    "inspect_graph": "hapd.ir.summary",
    "compile": "hapd.compiler.driver",
    "CompileOptions": "hapd.compiler.options",
    "Plan": "hapd.compiler.plan",
    "load_profile": "hapd.profile.schema",
    "distribute": "hapd.spmd.rewrite",
    "parallelize": "hapd.train.parallelize",
    "ParallelModule": "hapd.train.parallel_module",
    "UnevenSampler": "hapd.train.data",
    "UnevenBatchSampler": "hapd.train.data",
    "loader": "hapd.train.data",
    "mixed_loader": "hapd.train.mixed_length",
    "LengthCost": "hapd.train.mixed_length",
    "PackedLanguageModel": "hapd.models.packed",
    "Elastic": "hapd.elastic.resume",
    "save_checkpoint": "hapd.state.checkpoint",
    "load_checkpoint": "hapd.state.checkpoint",
    "export_safetensors": "hapd.state.checkpoint",
    "import_safetensors": "hapd.state.checkpoint",
    "check": "hapd.train.check",
    "GradScaler": "hapd.train.scaler",
    "module_init": "hapd.state.weights",
    "init_on_meta": "hapd.state.weights",
    "materialize": "hapd.state.weights",
    "normalize": "hapd.ir.normalize",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hapd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["HapdError", "__version__", *_LAZY]
