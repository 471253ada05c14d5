"""hapd.util: atomic writes leave the whole new file or the old one and no temporary
file; byte sizes for people; timing summaries."""

from __future__ import annotations

import math
import os
import stat

import pytest

from hapd.util import TimingSummary, atomic_file, atomic_write, format_bytes, summarize


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "plan.hplan"
    path.write_bytes(b"old")
    assert atomic_write(path, b"new bytes") == path
    assert path.read_bytes() == b"new bytes"
    atomic_write(str(path), "text é\n")
    assert path.read_text(encoding="utf-8") == "text é\n"
    assert os.listdir(tmp_path) == ["plan.hplan"]


def test_atomic_write_uses_the_mode_before_the_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a", b"x")
        atomic_write(tmp_path / "b", b"x", mode=0o600)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600


def test_a_writer_that_fails_mid_way_keeps_the_old_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_file(path) as handle:
            handle.write(b"half of the new")
            raise RuntimeError("disk on fire")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["profile.json"]


def test_a_failed_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")

    def refuse(src, dst):
        raise PermissionError(13, "refused", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        atomic_write(path, b"new")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.json"]


def test_the_temporary_file_is_hidden_and_ends_in_tmp(tmp_path):
    """The plan cache cleans ``*.tmp`` leftovers; the drop folder ignores hidden files."""
    path = tmp_path / "bert.pt2"
    with atomic_file(path) as handle:
        handle.write(b"x")
        (name,) = os.listdir(tmp_path)
        assert name.startswith(".bert.pt2.") and name.endswith(".tmp")
    assert os.listdir(tmp_path) == ["bert.pt2"]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (5 * 2**20, "5.00 MiB"),
        (2 * 2**30, "2.00 GiB"),
        (3 * 2**40, "3072.00 GiB"),
        (12.6, "13 B"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_summarize_known_times():
    s = summarize([0.4, 0.1, 0.3, 0.2, 1.0])
    assert s.count == 5
    assert s.mean == pytest.approx(0.4)
    assert s.std == pytest.approx(math.sqrt((0.0 + 0.09 + 0.01 + 0.04 + 0.36) / 5))
    assert (s.min, s.max, s.median, s.p90) == (0.1, 1.0, 0.3, 0.4)


def test_summarize_one_time_has_zero_spread():
    assert summarize([0.25]) == TimingSummary(1, 0.25, 0.0, 0.25, 0.25, 0.25, 0.25)


def test_summarize_no_times_is_nan():
    s = summarize([])
    assert s.count == 0
    assert all(math.isnan(v) for v in (s.mean, s.std, s.min, s.max, s.median, s.p90))


def test_gc_paused_nests_and_restores_the_collector_as_it_was():
    import gc

    from hapd.util import gc_paused

    was = gc.isenabled()
    try:
        gc.enable()
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the outer block still holds the pause
        assert gc.isenabled()
        gc.disable()
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
        gc.enable()
        with pytest.raises(RuntimeError):
            with gc_paused():
                raise RuntimeError("a failed compile")
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
