"""A running elastic job shares its exported program with the hosts that join it
(:mod:`hapd.elastic.export_share`): the weightless functional program a rank makes of
its export, taken by another process's model of the same export key, gives the graphs
(the same graph ids) and the values (loss and gradients) of that model's own export;
it keeps frozen parameters frozen and refuses a model that lacks a tensor; and the bytes
go through a real daemon's store, found by digest, once per run."""

from __future__ import annotations

import time

import pytest
import torch
from _hardening_daemon import ServedDaemon
from _wait import GENEROUS_S, wait_for
from torch import nn

from hapd.compiler.options import CompileOptions
from hapd.elastic import export_share
from hapd.elastic.in_place import IN_PLACE_ENV, RUN_ENV
from hapd.errors import PlanError
from hapd.train.parallelize import _recipe
from hapd.train.programs import SHARED_KEY, export_key, key_digest, shared_bytes, take_shared
from hapd.wire.client import Client
from hapd.wire.keys import load_key


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 32)
        self.emb.weight.requires_grad_(False)  # a frozen layer, as shipped models have

    def forward(self, ids, labels):
        logits = self.head(self.body(self.emb(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _recipe_of(seed: int):
    torch.manual_seed(seed)
    model = Tiny()
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(3))
    return _recipe(model, (ids, ids.clone()), None, name="tiny", profile="paper-8", plan=None, world=4, group=None,
                   device=None, use_daemon=False, verbose=False, weights=None, compile=False)


def _ids(graphs) -> list:
    return [graphs.full.graph_id, *[(k, v.graph_id) for k, v in sorted(graphs.micro.items())],
            graphs.half.graph_id if graphs.half is not None else None]


def _loss_and_grads(program, recipe):
    module = program.module()
    torch.manual_seed(11)  # the dropout draws
    loss = module(*recipe.example_inputs)
    params = [p for p in module.parameters() if p.requires_grad]
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, params)]


def test_a_shared_program_gives_what_the_model_s_own_export_gives():
    options = CompileOptions(pipeline="auto", overlap=True)
    sender = _recipe_of(0)
    sender.graphs(options)
    data = shared_bytes(sender)
    assert data and len(data) < 200_000  # the graph, not the weights

    joining, fresh = _recipe_of(1), _recipe_of(1)  # another process's model: other weights than the sender's
    take_shared(joining, data)
    assert _ids(joining.graphs(options)) == _ids(fresh.graphs(options))
    taken, own = joining.exported[SHARED_KEY], fresh.exported[SHARED_KEY]
    assert taken.state_dict["emb.weight"] is joining.model.emb.weight  # the joining model's tensors, not copies
    assert not taken.state_dict["emb.weight"].requires_grad
    loss_a, grads_a = _loss_and_grads(joining.export_at(True, 8)[0], joining)
    loss_b, grads_b = _loss_and_grads(fresh.export_at(True, 8)[0], fresh)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_a_shared_program_refuses_a_model_without_its_tensors():
    sender = _recipe_of(0)
    sender.graphs(CompileOptions(pipeline="auto"))
    data = shared_bytes(sender)
    other = _recipe_of(0)
    del other.model.head  # the program reads head.weight, which this model lacks
    other.model.head = None
    with pytest.raises(PlanError, match="head"):
        take_shared(other, data)


def test_the_program_goes_through_a_daemon_once_per_run(tmp_path, monkeypatch):
    with ServedDaemon(tmp_path / "hapd") as daemon:
        monkeypatch.setenv("HAPD_KEY_FILE", str(daemon.home / "key"))
        monkeypatch.setenv(RUN_ENV, "run-7")
        monkeypatch.setenv(IN_PLACE_ENV, "1")
        monkeypatch.setenv("HAPD_DAEMON", daemon.address)
        monkeypatch.setenv(export_share.DAEMONS_ENV, daemon.address)
        digest = key_digest(export_key(Tiny(), (torch.zeros(2, 3, dtype=torch.long),) * 2, (0, 0), "tiny",
                                       torch.device("cpu")))
        assert export_share.fetch(digest) is None  # nothing published yet
        made = []
        assert export_share.publish(digest, lambda: made.append(1) or b"program bytes")
        wait_for(lambda: export_share.fetch(digest) is not None, GENEROUS_S, "the program in the daemon's store")
        assert export_share.fetch(digest) == (b"program bytes", daemon.address)
        assert not export_share.publish(digest, lambda: made.append(1) or b"again")  # once per run and key
        assert made == [1]
        assert export_share.fetch("f" * 64) is None  # another model's key

        # a process that becomes rank 0 later (the first one killed) finds it held and makes nothing,
        # until no daemon holds it any more: then its refresh makes and puts it
        monkeypatch.setattr(export_share, "_claimed", set())
        monkeypatch.setattr(export_share, "_published", {})
        monkeypatch.setattr(export_share, "_found", {})
        later = []
        assert export_share.publish(digest, lambda: later.append(1) or b"program bytes")
        wait_for(lambda: ("run-7", digest) in export_share._found, GENEROUS_S, "the held program found")
        assert later == []
        store, _number = export_share.entry("run-7", digest)
        with Client(daemon.address, load_key(daemon.home / "key"), 5.0) as client:
            client.snapshot_drop(store)
        assert export_share.fetch(digest) is None
        assert export_share.refresh(now=time.monotonic() + export_share.REFRESH_S + 1) == 1
        wait_for(lambda: export_share.fetch(digest) is not None, GENEROUS_S, "the program made and put again")
        assert later == [1]

        monkeypatch.setenv(RUN_ENV, "run-8")
        assert export_share.fetch(digest) is None  # another run's


def test_nothing_is_published_outside_an_in_place_elastic_run(monkeypatch):
    monkeypatch.delenv(IN_PLACE_ENV, raising=False)
    monkeypatch.setenv(RUN_ENV, "run-9")
    monkeypatch.setenv("HAPD_DAEMON", "tcp://127.0.0.1:9")
    made = []
    assert not export_share.publish("a" * 64, lambda: made.append(1) or b"x")
    assert made == []  # not even made
