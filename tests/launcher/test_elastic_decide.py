"""The elastic launcher's decision after a generation failed, without daemons: what
goes on, on which hosts, and whether in place (:meth:`launcher.elastic.ElasticRun._decide`
and ``_attach_next``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from launcher.elastic import ElasticOptions, ElasticRun, Generation
from launcher.hosts import Host
from launcher.job import JobOptions, JobResult, Placement


def _run(tmp_path: Path, hosts: list[Host]) -> ElasticRun:
    key = tmp_path / "key"
    key.write_text("ab" * 32)
    os.chmod(key, 0o600)
    run = ElasticRun(hosts, JobOptions(script=Path("train.py"), job_id="decide", key_file=key),
                     ElasticOptions(1, 2), out=None, err=None)
    run._unanswering = lambda _hosts: set()  # every daemon answers: no pings here
    return run


def _two_hosts(tmp_path: Path) -> tuple[ElasticRun, Generation, SimpleNamespace, tuple[Host, Host]]:
    """Generation 0 on host a (rank 0) and host b (ranks 1-2), and its job as the decision reads it."""
    a, b = Host(name="10.0.0.1", slots=1), Host(name="10.0.0.2", slots=2)
    run = _run(tmp_path, [a, b])
    gen = Generation(0, "decide-g0", [a.label, b.label], 0.0)
    run.generations.append(gen)
    job = SimpleNamespace(job_id="decide-g0", placements=[Placement(a, 0, 0, 1), Placement(b, 1, 1, 2)], failed_at=1.0)
    return run, gen, job, (a, b)


def test_a_host_whose_only_rank_was_killed_leaves_and_the_others_switch_in_place(tmp_path):
    """Host a ran rank 0 alone, host b ranks 1-2; rank 0 was killed by a signal, the
    others parked. The launcher's wait ended on their parking, before host a's daemon
    said its job ended, so both hosts are left over (held): host a holds no rank now, and
    the next generation is b alone, switched in place (once it restarted every rank)."""
    run, gen, job, (a, b) = _two_hosts(tmp_path)
    result = JobResult("decide-g0", 137, 3, failure={"kind": "rank", "rank": 0, "code": 137, "host": a.label},
                       held=[a.label, b.label], killed={a.label: [0]}, after={a.label: 5, b.label: 7})
    decided = run._decide(gen, job, result, [a, b])
    assert [h.label for h in decided] == [b.label]
    assert result.held == [b.label]
    attach = run._attach_next(gen, job, result, decided, {})
    assert attach is not None and attach.generation == 1, attach
    assert run.dropped[-1]["host"] == a.label and run.dropped[-1]["why"] == "its ranks were killed"


def test_a_host_with_a_rank_left_goes_on_in_place_with_one_fewer(tmp_path):
    """Host b lost rank 2 of its ranks 1-2: both hosts go on in place, b with one rank."""
    run, gen, job, (a, b) = _two_hosts(tmp_path)
    result = JobResult("decide-g0", 137, 3, failure={"kind": "rank", "rank": 2, "code": 137, "host": b.label},
                       held=[a.label, b.label], killed={b.label: [2]})
    decided = run._decide(gen, job, result, [a, b])
    assert [h.label for h in decided] == [a.label, b.label]
    assert run._cut == {b.label: 1}
    assert run._attach_next(gen, job, result, decided, {}) is not None
