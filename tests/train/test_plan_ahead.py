"""Rank 0's plan asked for before the process group forms (:class:`PlanAhead`): the
same plan as asked for after, said to have been waited for only in part; a failure
told as one asked for after."""

from __future__ import annotations

import time

import pytest
import torch

from hapd import models
from hapd.compiler.options import CompileOptions
from hapd.errors import OptionsError, PlanError
from hapd.profile.schema import estimated_profile
from hapd.train import plan_source
from hapd.train.plan_source import PlanAhead, obtain_plan
from hapd.train.programs import Recipe


def _graph():
    model, config = models.build("mlp")
    inputs = models.get("mlp").example_inputs(config, 8)
    recipe = Recipe(model=model, example_inputs=tuple(inputs), batch_dims=(0,) * len(inputs), name="mlp",
                    profile=None, use_daemon=False, verbose=False, device=torch.device("cpu"))
    return recipe.export(True, recipe.example_shapes)[1]


def test_a_plan_asked_ahead_is_the_plan_asked_after():
    graph, profile, options = _graph(), estimated_profile(1), CompileOptions()
    ahead = PlanAhead(graph, profile, options, use_daemon=False)
    time.sleep(0.05)
    early = obtain_plan(graph, world=1, rank=0, profile=profile, options=options, use_daemon=False, ahead=ahead)
    late = obtain_plan(graph, world=1, rank=0, profile=profile, options=options, use_daemon=False)
    def chosen(plan):  # the program but the search's own statistics (its time)
        return {k: v for k, v in plan.program.items() if k != "stats"}

    assert chosen(early.plan) == chosen(late.plan) and early.plan.key == late.plan.key and early.origin == late.origin
    assert early.waited is not None and late.waited is None
    assert early.stood_s == early.waited <= early.seconds + 0.05 and late.stood_s == late.seconds


def test_a_plan_asked_ahead_that_failed_fails_as_one_asked_after(monkeypatch):
    def refused(*args, **kwargs):
        raise OptionsError("no plan for you")

    monkeypatch.setattr(plan_source, "compile_plan", refused)
    graph, profile, options = _graph(), estimated_profile(1), CompileOptions()
    ahead = PlanAhead(graph, profile, options, use_daemon=False)
    with pytest.raises(PlanError, match="rank 0 could not get a plan: OptionsError: no plan for you"):
        obtain_plan(graph, world=1, rank=0, profile=profile, options=options, use_daemon=False, ahead=ahead)
