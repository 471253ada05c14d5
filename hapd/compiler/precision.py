"""A graph as autocast runs it: the dtype each op's results get under ``torch.autocast``
to bf16 or fp16, so that the cost and memory models price activations, their
collectives and the memory they keep at the bytes a job in half precision has.

The rules are autocast's (``torch.amp``'s op lists, the CUDA ones, which the CPU's
follow for the ops hapd's graphs hold): an op of :data:`LOWER` (linear, matmul,
convolution, attention) computes in the half dtype and returns it; an op of
:data:`FP32` (norms, softmax, losses, reductions, exp/log/pow) computes in fp32 and
returns fp32; every other op returns the widest floating dtype among its tensor inputs
(torch's type promotion: a half activation plus an fp32 parameter is fp32). Parameters,
buffers and inputs keep their dtypes (fp32 master weights). Integer and boolean
results are not touched.

Only the pricing reads this graph: the plan's graph id and the rank programs are the
exported program's (fp32), which runs under autocast on the ranks.
"""

from __future__ import annotations

from typing import Any

from hapd.ir.lower import GraphIR, canonical_bytes

LOWER = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "einsum", "prelu",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
    "_convolution", "scaled_dot_product_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "chain_matmul", "multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell",
})
"""Ops autocast runs in the half dtype (their outputs are half)."""
FP32 = frozenset({
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "rms_norm", "softmax", "log_softmax",
    "_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss", "nll_loss2d", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss",
    "margin_ranking_loss", "cosine_embedding_loss", "hinge_embedding_loss", "poisson_nll_loss", "sum", "prod",
    "cumsum", "cumprod", "exp", "expm1", "log", "log10", "log2", "log1p", "pow", "rsqrt", "reciprocal", "norm",
    "logsumexp", "cosine_similarity", "dist", "cdist", "pdist", "renorm", "erfinv", "acos", "asin", "cosh",
    "sinh", "tan", "softplus", "frobenius_norm", "nuclear_norm",
})
"""Ops autocast runs in fp32 (their outputs are fp32 whatever their inputs)."""
FLOATS = ("float64", "float32", "bfloat16", "float16")
"""Floating dtypes, widest first."""
HALF = {"bf16": "bfloat16", "fp16": "float16"}


def op_base(op: str) -> str:
    """``aten.linear.default`` → ``linear``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 and parts[0] in ("aten", "prims") else parts[-1]


def autocast_doc(doc: dict[str, Any], precision: str) -> dict[str, Any]:
    """``doc`` (a graph IR document, changed in place and returned) with each op's
    floating results in the dtype autocast to ``precision`` gives them."""
    half = HALF[precision]
    dtypes: list[list[str]] = []
    for node in doc["nodes"]:
        outputs = node["outputs"]
        if node.get("kind") == "op":
            inputs = [dtypes[i][j] for i, j in node.get("inputs", []) if i < len(dtypes) and j < len(dtypes[i])]
            result = _result_dtype(op_base(str(node.get("op", ""))), inputs, half)
            for out in outputs:
                if result is not None and out.get("dtype") in FLOATS and out.get("dtype") != "float64":
                    out["dtype"] = result
        dtypes.append([str(out.get("dtype")) for out in outputs])
    return doc


def _result_dtype(op: str, inputs: list[str], half: str) -> str | None:
    """The floating dtype of an op's results under autocast; None: as the graph says."""
    if op in LOWER:
        return half
    if op in FP32:
        return "float32"
    floats = [d for d in inputs if d in FLOATS]
    if not floats:
        return None
    return min(floats, key=FLOATS.index)


def autocast_graph(data: bytes, precision: str) -> bytes:
    """The canonical bytes of graph ``data`` with autocast's dtypes (``precision`` bf16 or
    fp16); ``data`` itself for fp32."""
    if precision not in HALF:
        return data
    return canonical_bytes(autocast_doc(GraphIR(data).doc, precision))
