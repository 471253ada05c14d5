"""The plan cache: atomic entries, corruption is a miss, the LRU size bound, survival
across restarts, and the lp-only path for a changed profile."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hapd.serve.cache as cache_mod
from hapd.serve.cache import CacheKey, PlanCache, _pack_entry
from hapd.compiler.driver import compile as compile_plan
from hapd.compiler.options import CompileOptions
from hapd.errors import SynthesisError
from hapd.compiler.plan import Plan
from hapd.profile.schema import load_profile

OPTIONS = CompileOptions()


@pytest.fixture(scope="module")
def profiles():
    return load_profile("paper-8"), load_profile("paper-16")


@pytest.fixture(scope="module")
def bert(fixture_bytes) -> bytes:
    return fixture_bytes["bert"]


@pytest.fixture(scope="module")
def compiled(bert, profiles):
    """bert's plan for paper-8 and its key."""
    plan = compile_plan(bert, profiles[0], OPTIONS)
    return plan, CacheKey.of(plan.key["graph_id"], profiles[0], OPTIONS)


def entry_path(cache: PlanCache, key: CacheKey) -> Path:
    return cache.root / "plan" / key.digest[:2] / f"{key.digest}.entry"


def test_put_get_and_restart(tmp_path, compiled):
    plan, key = compiled
    cache = PlanCache(tmp_path, 10**8)
    assert cache.get(key) is None
    assert cache.put(key, plan.to_bytes())
    got, data = cache.get(key)
    assert data == plan.to_bytes() and got.key == plan.key
    again = PlanCache(tmp_path, 10**8)  # a restarted daemon
    assert again.stats()["entries"] == 1
    assert again.get(key)[1] == data
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("damage", ["flip payload", "flip header", "truncate", "empty", "garbage", "wrong magic"])
def test_corrupt_entry_is_a_logged_miss_and_removed(tmp_path, compiled, damage, caplog):
    plan, key = compiled
    cache = PlanCache(tmp_path, 10**8)
    cache.put(key, plan.to_bytes())
    path = entry_path(cache, key)
    blob = bytearray(path.read_bytes())
    if damage == "flip payload":
        blob[-100] ^= 0xFF
    elif damage == "flip header":
        blob[20] ^= 0x01
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "empty":
        blob = bytearray()
    elif damage == "garbage":
        blob = bytearray(os.urandom(len(blob)))
    elif damage == "wrong magic":
        blob[0:8] = b"NOTHAPD!"
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="hapd.cache"):
        assert cache.get(key) is None
    assert not path.exists()
    assert cache.stats()["corrupt"] == 1
    assert "corrupt or mismatched" in caplog.text


def test_mismatched_entries_are_misses(tmp_path, compiled, bert, profiles):
    plan, key = compiled
    cache = PlanCache(tmp_path, 10**8)
    other = CacheKey.of(key.graph_id, profiles[1], OPTIONS)
    # an entry copied under another key's name
    cache.put(key, plan.to_bytes())
    target = entry_path(cache, other)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(entry_path(cache, key).read_bytes())
    assert cache.get(other) is None and not target.exists()
    # a well-formed entry whose plan is for another profile
    blob = _pack_entry("plan", other.digest, plan.to_bytes(), other.parts(), other.family)
    target.write_bytes(blob)
    assert cache.get(other) is None and not target.exists()
    # a plan entry that is not a plan
    target.write_bytes(_pack_entry("plan", other.digest, b"\x81\xa1a\x01", other.parts(), other.family))
    assert cache.get(other) is None
    assert cache.stats()["corrupt"] == 3
    assert cache.get(key) is not None  # the good entry is untouched


def test_unfinished_writes_are_never_read_and_cleaned_at_start(tmp_path, compiled):
    plan, key = compiled
    cache = PlanCache(tmp_path, 10**8)
    path = entry_path(cache, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    # what a writer killed before its rename leaves behind
    tmp = path.with_name(f".{path.name}.123.abcd.tmp")
    tmp.write_bytes(b"HAPDCACH\x00\x00")
    assert cache.get(key) is None
    PlanCache(tmp_path, 10**8, clean_tmp=True)
    assert not tmp.exists()


def test_a_failed_write_leaves_no_entry(tmp_path, compiled, monkeypatch):
    plan, key = compiled
    cache = PlanCache(tmp_path, 10**8)

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_mod.os, "replace", crash)
    assert not cache.put(key, plan.to_bytes())  # a full disk: not cached, no error (served uncached)
    monkeypatch.undo()
    assert cache.get(key) is None
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.entry"))


def _keys(n: int) -> list[CacheKey]:
    return [CacheKey(f"{i:064x}", "p" * 64, "0", {"i": i}) for i in range(n)]


def test_lru_bound(tmp_path, compiled):
    plan, _ = compiled
    keys = _keys(4)
    data = plan.to_bytes()
    size = len(_pack_entry("plan", keys[0].digest, data, keys[0].parts(), keys[0].family))
    cache = PlanCache(tmp_path, int(size * 2.5))
    cache.put(keys[0], data)
    cache.put(keys[1], data)
    cache._read("plan", keys[0].digest)  # a use of keys[0]: keys[1] is now the oldest
    cache.put(keys[2], data)
    stats = cache.stats()
    assert stats["entries"] == 2 and stats["evictions"] == 1 and stats["bytes"] <= cache.max_bytes
    assert not entry_path(cache, keys[1]).exists()
    assert entry_path(cache, keys[0]).exists() and entry_path(cache, keys[2]).exists()
    # the order survives a restart (mtime), and a smaller bound evicts at start
    cache._read("plan", keys[0].digest)
    smaller = PlanCache(tmp_path, int(size * 1.5))
    assert smaller.stats()["entries"] == 1 and entry_path(cache, keys[0]).exists()
    # an entry larger than the bound is not cached at all
    tiny = PlanCache(tmp_path / "tiny", 100)
    assert not tiny.put(keys[3], data) and tiny.stats()["entries"] == 0


def test_compile_paths_hit_miss_and_lp_only(tmp_path, bert, profiles, compiled):
    p8, p16 = profiles
    cache = PlanCache(tmp_path, 10**8)
    first = cache.compile(bert, p8, OPTIONS)
    assert first.path == "miss"
    assert cache.compile(bert, p8, OPTIONS).path == "hit"
    moved = cache.compile(bert, p16, OPTIONS)
    assert moved.path == "lp-only"
    assert moved.plan.key["profile_id"] == p16.profile_id and moved.plan.key["options"] == OPTIONS.key()
    assert moved.plan.doc["stats"]["path"] == "lp-only"
    assert moved.plan.doc["stats"]["replanned_from"] == p8.profile_id
    # the same program (rule per op), re-costed: 16 ratios, and as good as a full compile here
    old_rules = [(s["node"], s["rule"]) for s in first.plan.program["steps"]]
    assert [(s["node"], s["rule"]) for s in moved.plan.program["steps"]] == old_rules
    assert len(moved.plan.ratios) == 16 and abs(sum(moved.plan.ratios) - 1) < 1e-6
    full = compile_plan(bert, p16, OPTIONS)
    # (to the LP solver's tolerance: a full compile also tries FLOP/s-proportional ratios)
    assert moved.plan.estimate["per_iteration"] == pytest.approx(full.estimate["per_iteration"], rel=1e-3)
    assert Plan.from_bytes(moved.data).key == moved.plan.key
    again = cache.compile(bert, p16, OPTIONS)
    assert again.path == "hit" and again.data == moved.data
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["lp_only"]) == (2, 1, 1)
    # without relp, or with other options, a full compile
    other = PlanCache(tmp_path / "b", 10**8)
    other.compile(bert, p8, OPTIONS)
    assert other.compile(bert, p16, OPTIONS, relp=False).path == "miss"
    assert other.compile(bert, p16, CompileOptions(zero=True)).path == "miss"


def test_lp_only_falls_back_to_a_full_compile(tmp_path, bert, profiles, monkeypatch):
    import hapd.compiler.replan

    p8, p16 = profiles
    cache = PlanCache(tmp_path, 10**8)
    cache.compile(bert, p8, OPTIONS)

    def unfit(*args, **kwargs):
        raise SynthesisError("the program does not fit")

    monkeypatch.setattr(hapd.compiler.replan, "relp_plan", unfit)
    served = cache.compile(bert, p16, OPTIONS)
    assert served.path == "miss" and "path" not in served.plan.doc["stats"]


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_fuzz_entry_files_are_never_served(tmp_path_factory, blob):
    root = tmp_path_factory.mktemp("fuzz")
    key = _keys(1)[0]
    cache = PlanCache(root, 10**6)
    path = entry_path(cache, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    assert cache.get(key) is None
    PlanCache(root, 10**6)  # the start-up scan copes too


def test_a_technique_search_is_re_planned_by_its_lp_for_a_host_subset(tmp_path, bert, profiles):
    """What an elastic job asks after losing a host: the technique search of the same
    graphs for the profile cut to the hosts left. The cached SPMD plan's program is
    re-costed and its LP re-solved (no search); a cached pipeline plan is not reused."""
    from hapd.ir.lower import GraphIR
    from hapd.compiler.techniques import GraphSet

    p8 = profiles[0]
    graphs = GraphSet(full=GraphIR(bert), missing={"pipeline": "not exported", "overlap": "not exported"})
    options = CompileOptions(pipeline="auto", overlap=True)
    cache = PlanCache(tmp_path, 10**8)
    first = cache.compile(graphs, p8, options)
    assert first.path == "miss" and first.plan.technique == "spmd"
    left = p8.on_hosts(p8.hosts[:-1])
    assert left.world < p8.world
    moved = cache.compile(graphs, left, options)
    assert moved.path == "lp-only" and moved.plan.technique == "spmd"
    assert len(moved.plan.ratios) == left.world
    assert moved.plan.key["graphs"] == graphs.key() and moved.plan.key["profile_id"] == left.profile_id
    assert [(s["node"], s["rule"]) for s in moved.plan.program["steps"]] == \
        [(s["node"], s["rule"]) for s in first.plan.program["steps"]]
    assert "LP-only re-plan" in moved.plan.estimate["techniques"]["pipeline"]["reason"]
    assert cache.compile(graphs, left, options).path == "hit"


def test_a_plan_whose_pipelines_an_older_cost_model_priced_is_a_miss(tmp_path, compiled):
    """A key that prices pipelines names the pipeline cost model's revision: a plan
    cached under another revision (an older hapd's pricing with the same version string)
    is not served, while a key that prices none keeps the key it had."""
    import dataclasses

    from hapd.compiler.pipeline.stage_cost import COST_MODEL_REVISION

    plan, key = compiled
    assert "cost_model" not in key.parts()  # SPMD only: keyed as before
    pipelines = CacheKey.of(key.graph_id, load_profile("paper-8"), CompileOptions(pipeline="auto"))
    assert pipelines.parts()["cost_model"] == COST_MODEL_REVISION
    older = dataclasses.replace(pipelines, cost_model="pipeline-1")
    assert older.digest != pipelines.digest and older.family != pipelines.family
    cache = PlanCache(tmp_path, 10**8)
    cache.put(older, plan.to_bytes())
    assert cache.get(pipelines) is None
