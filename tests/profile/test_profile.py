"""Cluster profiles: the bundled ones load, ids are canonical, bad fields are named,
the device count must match the job."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import FIXTURES

import hapd
from hapd.errors import ProfileError
from hapd.profile.assemble import summary
from hapd.profile.schema import COLLECTIVES, UNITS, estimated_profile, load_profile, profile_from_dict

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


@pytest.fixture(scope="module")
def paper8() -> dict:
    return json.loads((PROFILES / "paper-8.json").read_text())


@pytest.mark.parametrize(("name", "world"), [("paper-8", 8), ("paper-16", 16), ("paper-64", 64)])
def test_bundled_profiles_load(name, world):
    by_path = load_profile(PROFILES / f"{name}.json")
    by_name = load_profile(name)
    assert by_path == by_name
    assert by_path.world == world
    assert by_path.name == name
    assert [d.rank for d in by_path.devices] == list(range(world))
    assert set(by_path.collectives) == set(COLLECTIVES)
    assert sum(by_path.flops_ratios()) == pytest.approx(1.0)
    assert len(by_path.profile_id) == 64
    # the id survives a save and reload
    assert load_profile(load_profile(json.loads(by_path.to_json()))).profile_id == by_path.profile_id


def _reorder(value):
    """The same JSON value with every object's keys reversed."""
    if isinstance(value, dict):
        return {k: _reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reorder(v) for v in value]
    return value


def test_profile_id_ignores_key_order_and_whitespace(paper8, tmp_path):
    base = profile_from_dict(paper8).profile_id
    path = tmp_path / "reordered.json"
    path.write_text(json.dumps(_reorder(paper8), indent=7))
    assert load_profile(path).profile_id == base
    path.write_text(json.dumps(paper8, separators=(",", ":")))
    assert load_profile(path).profile_id == base
    renamed = dict(paper8, name="other", description="something else")
    assert profile_from_dict(renamed).profile_id == base
    as_ints = copy.deepcopy(paper8)
    as_ints["devices"][0]["memory"] = int(as_ints["devices"][0]["memory"])
    assert profile_from_dict(as_ints).profile_id == base


def test_profile_id_ignores_cosmetic_fields(paper8, tmp_path):
    base = profile_from_dict(paper8).profile_id
    cosmetic = copy.deepcopy(paper8)
    cosmetic.update(name="x", description="re-measured on Tuesday", measured_at="2031-01-01T00:00:00+00:00",
                    tool="hapd profile", fits={"all_reduce": {"inter": {"r2": 0.5}}})
    cosmetic["units"] = dict(reversed(list(UNITS.items())))
    path = tmp_path / "cosmetic.json"
    path.write_text(json.dumps(_reorder(cosmetic), indent=3))
    assert load_profile(path).profile_id == base
    assert load_profile(path).extra["measured_at"] == "2031-01-01T00:00:00+00:00"
    changed = copy.deepcopy(paper8)
    changed["devices"][0]["host"] = "elsewhere"
    assert profile_from_dict(changed).profile_id != base


def test_units_may_be_partial_or_absent(paper8):
    partial = dict(copy.deepcopy(paper8), units={"bandwidth": "bytes/s"})
    absent = {k: v for k, v in paper8.items() if k != "units"}
    assert profile_from_dict(partial).profile_id == profile_from_dict(absent).profile_id


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["devices"][3].update(flops=d["devices"][3]["flops"] * 1.01),
        lambda d: d["devices"][0].update(memory=1.0),
        lambda d: d["collectives"]["all_reduce"]["inter"].update(beta=1.0),
        lambda d: d["collectives"]["all_gather"]["intra"].update(alpha=0.5),
    ],
)
def test_profile_id_changes_with_a_number(paper8, edit):
    changed = copy.deepcopy(paper8)
    edit(changed)
    assert profile_from_dict(changed).profile_id != profile_from_dict(paper8).profile_id


def _drop_all_to_all(d):
    del d["collectives"]["all_to_all"]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_drop_all_to_all, "collectives.all_to_all"),
        (lambda d: d["collectives"]["all_reduce"]["inter"].update(beta=-1.0), "collectives.all_reduce.inter.beta"),
        (lambda d: d["collectives"]["broadcast"]["intra"].update(beta=0), "collectives.broadcast.intra.beta"),
        (lambda d: d["collectives"]["all_gather"]["inter"].update(alpha=-1e-6), "collectives.all_gather.inter.alpha"),
        (lambda d: d["collectives"].update(all_scatter={}), "collectives.all_scatter"),
        (lambda d: d["devices"][2].update(rank=5), "devices[2].rank"),
        (lambda d: d["devices"][1].update(flops="fast"), "devices[1].flops"),
        (lambda d: d["devices"][1].update(flops=True), "devices[1].flops"),
        (lambda d: d["devices"][4].update(memory=float("nan")), "devices[4].memory"),
        (lambda d: d["devices"][0].update(elementwise_flops=0), "devices[0].elementwise_flops"),
        (lambda d: d["devices"][0].update(host=""), "devices[0].host"),
        (lambda d: d.update(devices=[]), "devices"),
        (lambda d: d.update(format="hapd.graph"), "format"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["units"].update(bandwidth="elements/s"), "units.bandwidth"),
        (lambda d: d["units"].update(time="ms"), "units.time"),
        (lambda d: d["units"].update(speed="TFLOP/s"), "units.speed"),
        (lambda d: d["units"].update(size="MiB"), "units.size"),
        (lambda d: d["units"].update(energy="J"), "units.energy"),
        (lambda d: d.update(units="bytes"), "units"),
        (lambda d: d["collectives"].pop("broadcast"), "collectives.broadcast"),
        (lambda d: d["collectives"]["all_gather_grouped"].pop("inter"), "collectives.all_gather_grouped"),
        (lambda d: d["collectives"]["all_to_all"]["intra"].update(beta=-5.0), "collectives.all_to_all.intra.beta"),
        (lambda d: d["collectives"].update(p2p={"inter": {"alpha": 1e-5, "beta": 0}}), "collectives.p2p.inter.beta"),
        (lambda d: d["collectives"].update(p2p={"intra": {"alpha": 1e-5, "beta": 1e9}}), "collectives.p2p"),
        (lambda d: d["devices"][6].update(flops="3.8e12"), "devices[6].flops"),
        (lambda d: d["devices"][6].update(flops=None), "devices[6].flops"),
        (lambda d: d["devices"][2].update(elementwise_flops="fast"), "devices[2].elementwise_flops"),
    ],
)
def test_bad_fields_are_named(paper8, edit, field):
    bad = copy.deepcopy(paper8)
    edit(bad)
    with pytest.raises(ProfileError) as info:
        profile_from_dict(bad)
    assert info.value.field == field
    assert field.split(".")[-1].split("[")[0] in str(info.value)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["devices"][3].update(flopss=9e12),
     "devices[3].flopss: unknown key; known: rank, host, model, flops, memory, elementwise_flops, op_seconds, "
     "sync_overlap, dtype_flops, fused_attention (keys starting with _ are comments)"),
    (lambda d: d.update(collective={}), "collective: unknown key; known: format, version, name, description, units, "
                                        "devices, collectives, measured_at, tool,"),
    (lambda d: d["collectives"]["all_reduce"].update(inner={}), "collectives.all_reduce.inner: unknown key; known: inter, intra"),
    (lambda d: d["collectives"]["broadcast"]["inter"].update(gamma=1.0),
     "collectives.broadcast.inter.gamma: unknown key; known: alpha, beta"),
])
def test_a_misspelled_key_is_refused_naming_the_known_ones(paper8, edit, message):
    bad = copy.deepcopy(paper8)
    edit(bad)
    with pytest.raises(ProfileError) as info:
        profile_from_dict(bad)
    assert str(info.value).startswith(message) and info.value.field == message.split(":")[0]
    commented = copy.deepcopy(paper8)
    commented["_comment"] = "measured by hand"
    commented["devices"][0]["_note"] = "the fast one"
    assert profile_from_dict(commented).profile_id == profile_from_dict(paper8).profile_id


def test_a_point_to_point_link_is_optional_and_kept(paper8):
    """``p2p`` (one rank's message to another) may be given, inter and intra, and the
    core reads a profile with it; a profile without it is whole too."""
    with_p2p = copy.deepcopy(paper8)
    with_p2p["collectives"]["p2p"] = {"inter": {"alpha": 2e-5, "beta": 1.1e9}, "intra": {"alpha": 5e-6, "beta": 9e9}}
    profile = profile_from_dict(with_p2p)
    assert profile.collectives["p2p"]["inter"].beta == 1.1e9 and profile.collectives["p2p"]["intra"].alpha == 5e-6
    assert "p2p" not in profile_from_dict(paper8).collectives
    assert profile.profile_id != profile_from_dict(paper8).profile_id
    plan = hapd.compile(FIXTURES / "mlp.hapg", profile)  # the core accepts it
    assert plan.estimate["per_iteration"] > 0


def test_a_small_ops_seconds_are_optional_kept_and_checked(paper8):
    with_op = copy.deepcopy(paper8)
    for d in with_op["devices"]:
        d["op_seconds"] = 1.5e-5
    profile = profile_from_dict(with_op)
    assert {d.op_seconds for d in profile.devices} == {1.5e-5}
    assert profile_from_dict(paper8).devices[0].op_seconds is None
    assert profile.profile_id != profile_from_dict(paper8).profile_id
    assert profile_from_dict(json.loads(profile.to_json())).profile_id == profile.profile_id
    assert profile.subset([0, 1]).devices[1].op_seconds == 1.5e-5
    with_op["devices"][3]["op_seconds"] = -1.0
    with pytest.raises(ProfileError) as info:
        profile_from_dict(with_op)
    assert info.value.field == "devices[3].op_seconds"


def test_a_sync_overlap_is_optional_kept_and_checked(paper8):
    """``sync_overlap`` (the share of a gradient all-reduce hidden behind compute)
    round-trips, survives a subset, and leaves the id of a profile without it alone."""
    with_overlap = copy.deepcopy(paper8)
    for i, d in enumerate(with_overlap["devices"]):
        d["sync_overlap"] = [0.0, 0.62, 1][i % 3]
    profile = profile_from_dict(with_overlap)
    assert [d.sync_overlap for d in profile.devices[:3]] == [0.0, 0.62, 1.0]
    assert profile_from_dict(json.loads(profile.to_json())) == profile
    assert profile_from_dict(json.loads(profile.to_json())).profile_id == profile.profile_id
    assert profile.profile_id != profile_from_dict(paper8).profile_id
    assert profile.subset([2, 1]).devices[1].sync_overlap == 0.62
    assert "62% of a gradient sum hidden behind compute" in summary(profile)
    plain = profile_from_dict(paper8)
    assert plain.devices[0].sync_overlap is None
    assert all("sync_overlap" not in d for d in plain.canonical()["devices"])
    assert "hidden behind compute" not in summary(plain)
    assert hapd.compile(FIXTURES / "mlp.hapg", profile).estimate["per_iteration"] > 0  # the core accepts it


def test_fused_attention_is_optional_kept_and_reaches_the_core(paper8):
    """``fused_attention`` (hapd's fused attention kernel runs on the device) round-trips,
    survives a subset, is in the id and the core's map, and a profile without it keeps
    its id; the bundled paper cluster's V100s run it and its P100s (compute capability
    6.0) do not."""
    import msgpack

    profile = profile_from_dict(paper8)
    assert [d.fused_attention for d in profile.devices] == [True, True] + [False] * 6
    assert profile_from_dict(json.loads(profile.to_json())) == profile
    assert profile.subset([1, 2]).devices[0].fused_attention is True
    assert [d["fused_attention"] for d in msgpack.unpackb(profile.core_bytes())["devices"][1:3]] == [True, False]
    assert "fused attention kernel" in summary(profile).splitlines()[1]
    without = copy.deepcopy(paper8)
    for d in without["devices"]:
        del d["fused_attention"]
    plain = profile_from_dict(without)
    assert plain.devices[0].fused_attention is None and plain.profile_id != profile.profile_id
    assert all("fused_attention" not in d for d in plain.canonical()["devices"])
    assert hapd.compile(FIXTURES / "mlp.hapg", profile).estimate["per_iteration"] > 0  # the core accepts it


@pytest.mark.parametrize("value", ["yes", 1, 0.0, [True]])
def test_a_fused_attention_that_is_not_a_bool_is_named(paper8, value):
    bad = copy.deepcopy(paper8)
    bad["devices"][3]["fused_attention"] = value
    with pytest.raises(ProfileError, match=r"devices\[3\]\.fused_attention: expected true or false") as info:
        profile_from_dict(bad)
    assert info.value.field == "devices[3].fused_attention"


@pytest.mark.parametrize("value", [1.5, -0.1, "x", float("inf"), True])
def test_a_sync_overlap_outside_zero_to_one_is_named(paper8, value):
    bad = copy.deepcopy(paper8)
    bad["devices"][5]["sync_overlap"] = value
    with pytest.raises(ProfileError, match=r"devices\[5\]\.sync_overlap") as info:
        profile_from_dict(bad)
    assert info.value.field == "devices[5].sync_overlap"


def test_world_size_mismatch(paper8, tmp_path):
    assert profile_from_dict(paper8, world_size=8).world == 8
    with pytest.raises(ProfileError, match="8 devices but the job has 4 ranks") as info:
        profile_from_dict(paper8, world_size=4)
    assert info.value.field == "devices"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(paper8))
    assert load_profile(path, world_size=8).world == 8
    with pytest.raises(ProfileError, match="8 devices but the job has 2 ranks") as info:
        load_profile(path, world_size=2)
    assert info.value.field == "devices"
    profile = load_profile("paper-8")
    assert load_profile(profile, world_size=8) is profile
    with pytest.raises(ProfileError):
        load_profile(profile, world_size=16)
    with pytest.raises(ProfileError):
        load_profile(PROFILES / "paper-8.json", world_size=7)


def test_missing_or_unreadable_files(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile(tmp_path / "nope.json")
    assert info.value.field == "<file>"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError) as info:
        load_profile(bad)
    assert info.value.field == "<document>"
    with pytest.raises(ProfileError):
        profile_from_dict([1, 2, 3])


def test_a_profile_cut_to_the_hosts_a_job_runs_on(monkeypatch, tmp_path):
    """An elastic job that lost a host runs on the others: the cluster's profile is cut
    to their devices, in the order the launcher names them (HAPD_HOSTS)."""
    from hapd.errors import ProfileError
    from hapd.train.plan_source import JOB_HOSTS_ENV, job_profile

    paper = load_profile("paper-8")
    hosts = paper.hosts
    assert len(hosts) >= 2
    kept = paper.on_hosts([hosts[-1], hosts[0]])
    assert kept.world == len(paper.ranks_of(hosts[-1])) + len(paper.ranks_of(hosts[0]))
    assert [d.model for d in kept.devices] == [paper.devices[r].model for r in paper.ranks_of(hosts[-1])
                                                 + paper.ranks_of(hosts[0])]
    assert paper.on_hosts(hosts) is paper
    with pytest.raises(ProfileError, match="nowhere"):
        paper.on_hosts(["nowhere"])
    monkeypatch.setenv(JOB_HOSTS_ENV, ",".join(hosts[:-1]))
    cut = job_profile("paper-8", paper.world - len(paper.ranks_of(hosts[-1])))
    assert cut.hosts == hosts[:-1]
    with pytest.raises(ProfileError, match="ranks"):
        job_profile("paper-8", 3)  # the hosts named hold more devices than the job's ranks
    # every host, in another order (one left and joined again: it comes last): the
    # devices in the job's rank order, so a rank's share is its own device's
    rejoined = [*hosts[:1], *hosts[2:], hosts[1]]
    monkeypatch.setenv(JOB_HOSTS_ENV, ",".join(rejoined))
    ordered = job_profile("paper-8", paper.world)
    assert ordered.hosts == rejoined
    assert [d.model for d in ordered.devices] == [paper.devices[r].model for h in rejoined for r in paper.ranks_of(h)]
    monkeypatch.setenv(JOB_HOSTS_ENV, ",".join(hosts))
    assert job_profile("paper-8", paper.world).hosts == hosts
    # a host whose rank was killed goes on with fewer (HOST#N: its first N devices)
    two = estimated_profile(5, flops=[5e10, 4e10, 3e10, 2e10, 1e10], hosts=["a", "a", "a", "b", "b"], name="two")
    two_file = tmp_path / "two.json"
    two.save(two_file)
    monkeypatch.setenv(JOB_HOSTS_ENV, "a#2,b")
    cut = job_profile(two_file, 4)
    assert cut.hosts == ["a", "b"] and [d.flops for d in cut.devices] == [5e10, 4e10, 2e10, 1e10]
    assert [d.flops for d in two.on_hosts(["b#1", "a#1"]).devices] == [2e10, 5e10]
    with pytest.raises(ProfileError, match="more devices than"):
        two.on_hosts(["a#4"])
    with pytest.raises(ProfileError, match="HOST#N with N ≥ 1"):
        two.on_hosts(["a#0"])


def test_a_missing_profile_path_that_names_a_bundled_profile_says_so(tmp_path, monkeypatch):
    """From a folder outside the repository, ``profiles/paper-8.json`` is no file: the
    error names the bundled profile to give by name; an unknown name lists them."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError, match=r"did you mean paper-8\?") as typo:
        load_profile("profiles/paper-8.json")
    assert len(str(typo.value).splitlines()) <= 3  # a newcomer's mistake: the cause and the fix in ≤ 3 lines
    with pytest.raises(ProfileError, match=r"bundled profiles, by name: .*paper-8"):
        load_profile("paper-9")
    assert load_profile("paper-8").name == "paper-8"


def test_a_misspelled_collective_lists_the_known_ones(paper8):
    bad = copy.deepcopy(paper8)
    bad["collectives"]["all_reduc"] = bad["collectives"].pop("all_reduce")
    with pytest.raises(ProfileError) as info:
        profile_from_dict(bad)
    assert str(info.value).startswith("collectives: unknown collective 'all_reduc'; known: all_gather")
    assert "all_reduce" in str(info.value) and info.value.field == "collectives.all_reduc"
