"""What hapd's fused counter attention costs against torch's fused attention with dropout.

    PYTHONPATH=. python bench/attention_kernel.py             # 8×12×1024×64, fp32 and bf16
    PYTHONPATH=. python bench/attention_kernel.py --causal --repeats 20

On CUDA, per dtype, the median time of a forward and backward of:

- ``torch``: ``scaled_dot_product_attention(q, k, v, dropout_p=0.1)`` (torch's fused
  kernel, its own generator: no slice of its mask can be drawn alone);
- ``fused``: :func:`hapd.spmd.random.attention_kernels.fused_attention`, the same
  attention with hapd's counter-based draw (what a rank's ``CounterAttention`` runs);

and the ratio ``fused / torch``, with the peak memory each adds over its inputs. On a
machine without CUDA it says so and runs a tiny check of the math path (the Triton
kernels run on CPU only under the interpreter, which is for tests), then exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hapd.spmd.random import attention_kernels, counter_kernels  # noqa: E402
from hapd.spmd.random.random_ops import CounterAttention  # noqa: E402

SHAPE = (8, 12, 1024, 64)
"""Batch, heads, sequence, head dim: a GPT-2 paper-size attention."""
P = 0.1
"""The dropout probability of both attentions."""


def timed(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` on the GPU after two warm-up calls (the first compiles)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], None]) -> int:
    """The most memory ``fn`` holds at once beyond what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def row(dtype: torch.dtype, causal: bool, repeats: int) -> dict[str, float]:
    """Times and peak memory of both attentions, forward and backward, in ``dtype``."""
    device = torch.device("cuda")
    b, h, s, d = SHAPE
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)
    step, part = torch.tensor(3, device=device), torch.tensor(0, device=device)

    def torch_attention() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad)

    def fused_attention() -> None:
        out = attention_kernels.fused_attention(q, k, v, None, p=P, is_causal=causal, scale=None, enable_gqa=False,
                                                seed=7, stream=5, step=step, part=part, duplica=0,
                                                global_shape=[b, h, s, s], offsets=[0, 0, 0, 0])
        if out is None:
            raise RuntimeError("the fused attention did not take the benchmark's attention")
        torch.autograd.grad(out, (q, k, v), grad)

    result = {"torch_s": timed(torch_attention, repeats), "fused_s": timed(fused_attention, repeats),
              "torch_bytes": float(peak_bytes(torch_attention)), "fused_bytes": float(peak_bytes(fused_attention))}
    result["ratio"] = result["fused_s"] / result["torch_s"]
    return result


def smoke() -> None:
    """A tiny math-path attention on the CPU: finite, the shape asked, and the fused
    attention declining a CPU tensor (Triton is never run there without the interpreter)."""
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    module = CounterAttention(P, 0, [1, 2, 16, 16], [0, 0, 0, 0], 7, is_causal=True, scale=None, enable_gqa=False)
    out = module(q, k, v, None, torch.tensor(1), torch.tensor(0))
    assert out.shape == (1, 2, 16, 32) and torch.isfinite(out).all()
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not counter_kernels.available(q)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--causal", action="store_true", help="a causal attention (default: no mask)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per attention (median)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: the fused attention runs on CUDA; checked the math path on the CPU instead")
        smoke()
        return 0
    print(f"attention fwd+bwd {list(SHAPE)}, dropout {P}, {'causal' if args.causal else 'no mask'}, "
          f"{torch.cuda.get_device_name()}")
    for dtype in (torch.float32, torch.bfloat16):
        r = row(dtype, args.causal, args.repeats)
        print(f"{str(dtype).removeprefix('torch.'):<9} torch {r['torch_s'] * 1e3:8.3f} ms "
              f"{r['torch_bytes'] / 2**20:8.1f} MiB   fused {r['fused_s'] * 1e3:8.3f} ms "
              f"{r['fused_bytes'] / 2**20:8.1f} MiB   fused/torch {r['ratio']:.2f}× time, "
              f"{r['fused_bytes'] / max(r['torch_bytes'], 1.0):.2f}× memory", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
