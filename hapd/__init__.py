"""hapd: automatic SPMD training for PyTorch on heterogeneous GPU clusters.

Heavy entry points (they import torch) load on first use, so light modules such as
``hapd.errors`` and ``hapd.serve.client`` stay cheap to import.
"""

from __future__ import annotations

import importlib
from typing import Any

from hapd.errors import HapdError

__version__ = "0.3.0"

# public name -> module that defines it
_LAZY = {
    "export": "hapd.compiler.export",
    "lower": "hapd.compiler.lower",
    "GraphIR": "hapd.compiler.lower",
    "inspect_graph": "hapd.compiler.summary",
    "compile": "hapd.compiler.driver",
    "CompileOptions": "hapd.compiler.options",
    "Plan": "hapd.compiler.plan",
    "load_profile": "hapd.profile.schema",
    "distribute": "hapd.runtime.rewrite",
    "parallelize": "hapd.runtime.parallelize",
    "ParallelModule": "hapd.runtime.parallel_module",
    "UnevenSampler": "hapd.runtime.data",
    "UnevenBatchSampler": "hapd.runtime.data",
    "loader": "hapd.runtime.data",
    "mixed_loader": "hapd.runtime.mixed_length",
    "LengthCost": "hapd.runtime.mixed_length",
    "PackedLanguageModel": "hapd.models.packed",
    "Elastic": "hapd.runtime.elastic",
    "save_checkpoint": "hapd.runtime.checkpoint",
    "load_checkpoint": "hapd.runtime.checkpoint",
    "export_safetensors": "hapd.runtime.checkpoint",
    "import_safetensors": "hapd.runtime.checkpoint",
    "check": "hapd.runtime.check",
    "module_init": "hapd.runtime.weights",
    "init_on_meta": "hapd.runtime.weights",
    "materialize": "hapd.runtime.weights",
    "normalize": "hapd.compiler.normalize",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hapd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["HapdError", "__version__", *_LAZY]
