"""Issue 51: bad inputs to a one-process ``hapd.parallelize`` module fail as eager
PyTorch fails where torch raises the same error, and with a
:class:`~hapd.errors.HapdError` naming the argument and what it should be where the
failure is hapd's own: token ids or class labels given as floats or bools in the example
batch (traced without complaint, or failing inside ``torch.export``), a model on the meta
device. Forward inputs of another dtype, ``backward()`` twice and backward of a
``no_grad`` loss raise torch's own error, as the eager model does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapd
from hapd.errors import HapdError, OptionsError, WeightsError
from hapd.ir.export import export
from hapd.train.programs import check_index_inputs

B, SEQ, VOCAB = 4, 5, 16


class TokenModel(nn.Module):
    """Token ids and class labels in, the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.embed(input_ids)).flatten(0, 1), labels.flatten())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=generator)
    return ids, ids.roll(-1, 1)


@pytest.fixture(scope="module")
def pair() -> tuple[nn.Module, nn.Module]:
    """(the eager model, its hapd module on one process), with the same weights."""
    torch.manual_seed(0)
    eager = TokenModel()
    torch.manual_seed(0)
    return eager, hapd.parallelize(TokenModel(), _batch(), use_daemon=False, verbose=False)


def _error(run) -> BaseException:
    with pytest.raises(Exception) as caught:
        run()
    return caught.value


def _twice(model: nn.Module) -> None:
    loss = model(*_batch())
    loss.backward()
    loss.backward()


def _after_no_grad(model: nn.Module) -> None:
    with torch.no_grad():
        loss = model(*_batch())
    loss.backward()


@pytest.mark.parametrize("case", ["float ids", "bool ids", "float64 labels", "backward twice",
                                  "backward after no_grad"])
def test_what_eager_torch_refuses_is_refused_with_torchs_error(pair, case):
    ids, labels = _batch()
    runs = {"float ids": lambda m: m(ids.float(), labels), "bool ids": lambda m: m(ids.bool(), labels),
            "float64 labels": lambda m: m(ids, labels.double()), "backward twice": _twice,
            "backward after no_grad": _after_no_grad}
    eager, module = pair
    expected, got = _error(lambda: runs[case](eager)), _error(lambda: runs[case](module))
    assert type(got) is type(expected) and str(got) == str(expected)
    assert not isinstance(got, HapdError)


@pytest.mark.parametrize(("ids_dtype", "labels_dtype", "named"), [
    (torch.float32, torch.long, "example input input_ids is torch.float32, and the model uses it as indices "
                                "(aten.embedding: token ids or class labels): give it as integers (torch.long)"),
    (torch.bool, torch.long, "example input input_ids is torch.bool, and the model uses it as indices "
                             "(aten.embedding"),
    (torch.long, torch.bool, "example input labels is torch.bool, and the model uses it as indices "
                             "(aten.cross_entropy_loss"),
    (torch.long, torch.float64, "example input labels (torch.float64) is used as indices (token ids or class labels) "
                                "by TokenModel's forward, which needs integers: give it as torch.long"),
])
def test_an_example_batch_of_float_or_bool_indices_is_named(ids_dtype, labels_dtype, named):
    """torch.export traces float or bool token ids without complaint (every forward
    would then fail), and fails inside on float labels: both name the argument."""
    ids, labels = _batch()
    with pytest.raises(OptionsError) as caught:
        hapd.parallelize(TokenModel(), (ids.to(ids_dtype), labels.to(labels_dtype)), use_daemon=False, verbose=False)
    assert str(caught.value).startswith(named), caught.value


def test_class_probabilities_as_float_targets_are_not_indices():
    class Soft(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.head(x), target)

    x, target = torch.randn(4, 8), torch.softmax(torch.randn(4, 3), -1)
    check_index_inputs(export(Soft(), (x, target)))  # no error: a float target of the logits' shape


def test_a_meta_device_model_is_told_to_pass_weights():
    with torch.device("meta"):
        model = TokenModel()
    with pytest.raises(WeightsError, match=r"TokenModel is on the meta device: pass weights="):
        hapd.parallelize(model, _batch(), use_daemon=False, verbose=False)


def test_keyword_arguments_reach_the_forward_by_name(pair):
    eager, module = pair
    ids, labels = _batch()
    assert float(module(input_ids=ids, labels=labels).detach()) == pytest.approx(
        float(eager(input_ids=ids, labels=labels).detach()))
    assert float(module(ids, labels=labels).detach()) == pytest.approx(float(eager(ids, labels=labels).detach()))
