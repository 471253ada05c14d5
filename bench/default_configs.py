"""transformers models as their library configures them, on a cluster profile.

    .venv/bin/python bench/default_configs.py                    # paper-8, batch 32 x 64 tokens
    .venv/bin/python bench/default_configs.py --dropout 0        # every dropout set to 0
    .venv/bin/python bench/default_configs.py --models bert gpt2 --profile paper-8

BERT, GPT-2, T5, RoBERTa and Whisper, each built from its transformers config with
every default left alone (dropout included: 0.1 for BERT, GPT-2, T5 and RoBERTa; Whisper
defaults to 0) except the sizes: width 256, 4 layers (T5 and Whisper: 4 encoder and 4
decoder layers), 4 heads, FFN 1024, vocabulary 1024, sequence 64 (Whisper: 128 mel
frames, 64 target tokens), random init. Each is exported at global batch ``--batch``,
lowered and compiled for ``--profile``; a row gives the plan's replicated FLOP share,
its estimated seconds per iteration against the DP-EV and DP-CP baselines, the
compile time and, where the plan is costlier than DP-CP, what the compile says forced
it.

A model that does not export or lower prints its error instead of a row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hapd  # noqa: E402

WIDTH, LAYERS, HEADS, FFN, VOCAB, SEQ = 256, 4, 4, 1024, 1024, 64
"""The sizes every model is built at (the zoo's ``small``)."""


class _Loss(nn.Module):
    """A transformers model whose forward returns its own loss for ``(inputs, labels)``
    (``input_features`` for Whisper, ``input_ids`` for the rest)."""

    def __init__(self, model: nn.Module, input_name: str):
        super().__init__()
        self.model, self.input_name = model, input_name

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        return self.model(**{self.input_name: inputs}, labels=labels).loss


def _tokens(batch: int, low: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(low, VOCAB, (batch, SEQ), generator=g)
    return ids, ids.clone()


def _dropouts(dropout: float | None, *names: str) -> dict[str, float]:
    return {} if dropout is None else dict.fromkeys(names, dropout)


def bert(t, batch: int, dropout: float | None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    config = t.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          intermediate_size=FFN, max_position_embeddings=SEQ,
                          **_dropouts(dropout, "hidden_dropout_prob", "attention_probs_dropout_prob"))
    return _Loss(t.BertForMaskedLM(config), "input_ids"), _tokens(batch)


def roberta(t, batch: int, dropout: float | None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    # RoBERTa's positions start after its padding id (1): the table needs SEQ + 2 rows
    config = t.RobertaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=SEQ + 2,
                             **_dropouts(dropout, "hidden_dropout_prob", "attention_probs_dropout_prob"))
    return _Loss(t.RobertaForMaskedLM(config), "input_ids"), _tokens(batch, low=2)


def gpt2(t, batch: int, dropout: float | None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    config = t.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                          bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                          **_dropouts(dropout, "resid_pdrop", "embd_pdrop", "attn_pdrop"))
    return _Loss(t.GPT2LMHeadModel(config), "input_ids"), _tokens(batch)


def t5(t, batch: int, dropout: float | None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    config = t.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=LAYERS,
                        num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0,
                        **_dropouts(dropout, "dropout_rate"))
    return _Loss(t.T5ForConditionalGeneration(config), "input_ids"), _tokens(batch, low=1)


def whisper(t, batch: int, dropout: float | None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    mels, frames = 80, 2 * SEQ
    config = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=mels, d_model=WIDTH, encoder_layers=LAYERS,
                             decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                             encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_source_positions=frames // 2,
                             max_target_positions=SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                             decoder_start_token_id=1,
                             **_dropouts(dropout, "dropout", "attention_dropout", "activation_dropout"))
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch, mels, frames, generator=g)
    labels = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    return _Loss(t.WhisperForConditionalGeneration(config), "input_features"), (features, labels)


MODELS: dict[str, Callable[..., tuple[nn.Module, tuple[Tensor, ...]]]] = {
    "bert": bert, "gpt2": gpt2, "t5": t5, "roberta": roberta, "whisper": whisper,
}
"""Name → ``(transformers, batch, dropout) -> (loss module, example inputs)``."""


def measure(name: str, batch: int, profile: str, dropout: float | None) -> str:
    """One model's row: build (seed 0), export, lower and compile it."""
    import transformers

    torch.manual_seed(0)
    module, inputs = MODELS[name](transformers, batch, dropout)
    module.model.config._attn_implementation = "sdpa"
    module.model.config.use_cache = False
    start = time.perf_counter()
    graph = hapd.lower(hapd.export(module.train(), inputs, name=name), name=name)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = hapd.compile(graph, profile)
    compile_s = time.perf_counter() - start
    dp_ev, dp_cp = plan.doc["baselines"]["dp_ev"], plan.doc["baselines"]["dp_cp"]
    estimate = plan.estimate["per_iteration"]
    drop = [n for n in graph.doc["nodes"] if "dropout" in (n.get("op") or "")]
    row = (f"{name:<8} {len(drop):>5} {plan.estimate['replicated_flop_share']:>6.1%} {estimate * 1e3:>8.2f}ms "
           f"{dp_ev * 1e3:>8.2f}ms {dp_cp * 1e3:>8.2f}ms {estimate / dp_cp:>6.3f}x {lower_s:>7.2f} {compile_s:>9.2f}")
    forced = plan.doc.get("stats", {}).get("worse_than_dp")
    if forced:
        row += "\n         worse than DP-CP: " + "; ".join(forced.get("reasons", []))
    return row


HEADER = (f"{'model':<8} {'drops':>5} {'repl':>6} {'plan':>10} {'DP-EV':>10} {'DP-CP':>10} {'/DP-CP':>7} "
          f"{'lower s':>7} {'compile s':>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="paper-8", help="profile name or path (default paper-8)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dropout", type=float, default=None,
                        help="set every dropout of every model to this (default: the library's defaults)")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    which = "library defaults" if args.dropout is None else f"every dropout {args.dropout}"
    print(f"transformers {transformers.__version__} models on {args.profile}, batch {args.batch} x {SEQ}, "
          f"dropout: {which}")
    print(HEADER)
    for name in args.models:
        try:
            print(measure(name, args.batch, args.profile, args.dropout), flush=True)
        except Exception as exc:  # a model that fails is a line of the report, not the end of it
            print(f"{name:<8} failed: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
