"""What hapd's counter-based draw costs against torch's own dropout, and whether the
fused kernel draws the bits of the torch ops.

    python bench/counter_draw.py                  # CUDA when there is one, else CPU
    python bench/counter_draw.py --out DIR        # + DIR/counter_draw.json

Per shape and dtype (default: a GPT-2 hidden state, 8×1024×768, and its attention
probabilities, 8×12×1024×1024), the median time of:

- ``native``: ``torch.ops.aten.native_dropout`` (torch's fused kernel, its generator);
- ``counter-ops``: :class:`hapd.spmd.random.random_ops.CounterDropout` drawing with torch ops
  (about 15 element-wise kernels: what ran before the fused kernel, and on CPU);
- ``counter-fused``: the same module with :mod:`hapd.spmd.random.counter_kernels`' one
  Triton kernel (CUDA only);

each as a ratio to ``native``; and the attention of the 8×12×1024×64 heads with dropout
0.1: torch's ``scaled_dot_product_attention`` against
:class:`hapd.spmd.random.random_ops.CounterAttention` (on CUDA the fused kernel of
:mod:`hapd.spmd.random.attention_kernels`, on CPU the math attention), forward and
backward. On CUDA the fused masks and results are compared bit for bit with the torch
ops run on the CPU: the last line says whether they are equal, and the script exits 1
when they differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hapd.spmd.random import counter_kernels  # noqa: E402
from hapd.spmd.random.random_ops import CounterAttention, CounterDropout  # noqa: E402

SHAPES = {"hidden": (8, 1024, 768), "probabilities": (8, 12, 1024, 1024)}
"""Default shapes: a GPT-2 paper-size hidden state and its attention probabilities."""


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _without_fused(module: CounterDropout, *args: Any) -> Any:
    """The module's torch-op draw (the fused kernel switched off for this call)."""
    saved = counter_kernels.available
    counter_kernels.available = lambda _x: False  # type: ignore[assignment]
    try:
        return module(*args)
    finally:
        counter_kernels.available = saved  # type: ignore[assignment]


def dropout_rows(device: torch.device, shapes: dict[str, tuple[int, ...]], dtypes: list[torch.dtype],
                 repeats: int) -> list[dict[str, Any]]:
    rows = []
    step, part = torch.tensor(3, device=device), torch.tensor(0, device=device)
    for name, shape in shapes.items():
        for dtype in dtypes:
            x = torch.randn(shape, device=device, dtype=dtype)
            module = CounterDropout(0.1, True, 4, [shape[0] * 2, *shape[1:]], [shape[0], *[0] * (len(shape) - 1)], 7)
            row: dict[str, Any] = {"shape": list(shape), "what": name, "dtype": str(dtype).removeprefix("torch.")}
            row["native_s"] = timed(lambda: torch.ops.aten.native_dropout(x, 0.1, True), device, repeats)
            row["counter_ops_s"] = timed(lambda: _without_fused(module, x, step, part), device, repeats)
            if counter_kernels.available(x):
                row["counter_fused_s"] = timed(lambda: module(x, step, part), device, repeats)
                out, mask = module(x, step, part)
                ref_out, ref_mask = _without_fused(module, x.cpu(), step.cpu(), part.cpu())
                row["fused_mask_equal_cpu"] = bool(torch.equal(mask.cpu(), ref_mask))
                row["fused_result_equal_cpu"] = bool(torch.equal(out.cpu(), ref_out))
            for key in ("counter_ops_s", "counter_fused_s"):
                if key in row:
                    row[key.replace("_s", "_ratio")] = row[key] / row["native_s"]
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def attention_row(device: torch.device, dtype: torch.dtype, repeats: int, batch: int) -> dict[str, Any]:
    b, h, s, d = batch, 12, 1024, 64
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    step, part = torch.tensor(3, device=device), torch.tensor(0, device=device)
    counter = CounterAttention(0.1, 5, [b, h, s, s], [0, 0, 0, 0], 7, is_causal=True, scale=None, enable_gqa=False)

    def torch_attention() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum().backward()

    def counter_attention() -> None:
        counter(q, k, v, None, step, part).sum().backward()

    row: dict[str, Any] = {"what": "attention fwd+bwd, causal, dropout 0.1", "shape": [b, h, s, d],
                           "dtype": str(dtype).removeprefix("torch.")}
    row["native_s"] = timed(torch_attention, device, repeats)
    row["counter_s"] = timed(counter_attention, device, repeats)
    row["counter_ratio"] = row["counter_s"] / row["native_s"]
    print(_line(row), flush=True)
    return row


def _line(row: dict[str, Any]) -> str:
    parts = [f"{row['what']:<40} {str(row['shape']):<22} {row['dtype']:<9} native {row['native_s'] * 1e3:8.3f} ms"]
    for key, label in (("counter_ops", "counter (torch ops)"), ("counter_fused", "counter (fused)"),
                       ("counter", "counter attention")):
        if f"{key}_s" in row:
            parts.append(f"{label} {row[key + '_s'] * 1e3:8.3f} ms ({row[key + '_ratio']:.2f}×)")
    if "fused_mask_equal_cpu" in row:
        parts.append(f"bits equal to the CPU's: mask {row['fused_mask_equal_cpu']}, "
                     f"result {row['fused_result_equal_cpu']}")
    return "  ".join(parts)


def differing(rows: list[dict[str, Any]]) -> list[str]:
    """``WHAT DTYPE (mask, result)`` of each row whose fused bits differ from the CPU's."""
    out = []
    for row in rows:
        parts = [part for part in ("mask", "result") if row.get(f"fused_{part}_equal_cpu") is False]
        if parts:
            out.append(f"{row['what']} {row['dtype']} ({', '.join(parts)})")
    return out


def exit_status(rows: list[dict[str, Any]]) -> int:
    """The script's exit code: 1 when the fused kernel's bits differ from the CPU's, else 0."""
    return 1 if differing(rows) else 0


def verdict(rows: list[dict[str, Any]]) -> str:
    """The last line: whether the fused kernel's bits equal the CPU's torch ops."""
    differ = differing(rows)
    if differ:
        return f"FAILED: the fused kernel's bits differ from the CPU's torch ops in {'; '.join(differ)}: exit 1"
    compared = sum(1 for row in rows if "fused_mask_equal_cpu" in row)
    if not compared:
        return "no fused kernel ran (no CUDA): no bits compared"
    return f"the fused kernel's bits equal the CPU's torch ops in all {compared} row(s) compared"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 20; CPU 3)")
    parser.add_argument("--small", action="store_true", help="shapes 8× smaller along the batch (a quick check)")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/counter_draw.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    shapes = {name: (1, *shape[1:]) for name, shape in SHAPES.items()} if args.small else dict(SHAPES)
    dtypes = [torch.float32, torch.bfloat16]
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"median of {repeats}", flush=True)
    rows = dropout_rows(device, shapes, dtypes, repeats)
    for dtype in dtypes if device.type == "cuda" else [torch.float32]:
        rows.append(attention_row(device, dtype, repeats, shapes["hidden"][0]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "counter_draw.json").write_text(json.dumps(rows, indent=1))
    print(verdict(rows), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(exit_status(main()))
