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
from hapd.ir.lower import GraphIR
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
        time.sleep(0.3)
        assert made == [] and export_share.fetch(digest) is None  # not made before the next step ended
        export_share.refresh()  # a step done
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
        export_share.refresh()
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


def test_a_rank_that_asks_no_plan_derives_only_the_graphs_it_checks_and_runs():
    """Only rank 0 asks for the plan: another rank (a joining host's, exporting ahead)
    derives the global batch's graph and the half batch's (overlap), the same graphs
    rank 0 prices, and none of the pipelines' micro-batches, whose program is cut only
    when a pipeline's plan wins."""
    from hapd.train.parallelize import _plan_request

    options = CompileOptions(pipeline="auto", overlap=True)
    priced, rank0 = _recipe_of(0), _recipe_of(0)
    everything = priced.graphs(options)
    assert everything.micro  # rank 0 prices the pipelines' micro-batches (batch 8: 2, 4 and 8 of them)
    other = _recipe_of(0)
    request = _plan_request(other, None, options, False, rank=1)
    assert request.graph.micro == {} and request.runs is None
    assert request.graph.full.graph_id == everything.full.graph_id
    assert request.graph.half is not None and request.graph.half.graph_id == everything.half.graph_id
    assert ("at", True, 2) not in other.exported and ("at", True, 1) not in other.exported  # 4 and 8 micro-batches
    assert _plan_request(rank0, None, options, False, rank=0).graph.key() == everything.key()
    cut = other.export_at(True, 2)  # a pipeline's micro-batch program, when its plan wins: cut then
    assert cut[1].graph_id == everything.micro[4].graph_id


def test_exports_carried_over_the_same_model_are_taken_as_they_are(monkeypatch):
    """A joining host's rank exports ahead, then the same parallelize call takes those
    exports from the carry over the same model: they are already over its tensors and
    come back as they are (no rebinding); over another model of the same structure
    (the script run again after a switch) they are rebound to its tensors."""
    from hapd.train import programs

    monkeypatch.setenv("HAPD_KEEP_EXPORTS", "1")
    options = CompileOptions(pipeline="auto", overlap=True)
    joining = _recipe_of(0)
    take_shared(joining, shared_bytes(_shared_sender(options)))
    joining.graphs(options)
    key = export_key(joining.model, joining.example_inputs, joining.batch_dims, joining.name, joining.device)
    kept = dict(joining.exported)
    carry = programs.ExportCarry()
    carry.keep(key, joining.exported)
    taken = carry.take(key, joining.model)
    assert taken.keys() == kept.keys()
    assert all(taken[k] is kept[k] for k in kept)  # the very programs: over this model already
    held = [v[0] if isinstance(v, tuple) else v for v in taken.values() if not isinstance(v, GraphIR)]
    assert held and all(programs.bound_to(v, joining.model) for v in held)  # a priced graph alone holds no tensor

    again = _recipe_of(1)  # the script run again: the same structure, new tensors
    carry.keep(key, kept)
    rebound = carry.take(key, again.model)
    program = rebound[SHARED_KEY]
    assert program is not kept[SHARED_KEY] and not programs.bound_to(kept[SHARED_KEY], again.model)
    assert programs.bound_to(program, again.model)
    assert program.state_dict["head.weight"] is again.model.head.weight


def _shared_sender(options):
    sender = _recipe_of(5)
    sender.graphs(options)
    return sender
