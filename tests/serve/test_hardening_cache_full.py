"""Issue 17, item 4: a full disk under the plan cache. Compiles still succeed, the plan
is served uncached (the reply and the drop report say ``cache full``), the daemon warns
once, and caches again once a write succeeds. In process with the write failing as a
full file system fails it, and (as root) with a real full tmpfs in a mount namespace."""

from __future__ import annotations

import errno
import logging
import os

import pytest
from _hardening_daemon import FIXTURES, ServedDaemon, can_mount_tmpfs
from _wait import GENEROUS_S, wait_for

from hapd.compiler.options import CompileOptions
from hapd.profile.schema import load_profile
from hapd.serve.cache import CACHE_FULL, PlanCache

NO_SPACE = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch):
    """Every atomic write fails as on a full file system, until undone."""

    def no_space(path, data, *, mode=0o666):
        raise NO_SPACE

    monkeypatch.setattr("hapd.serve.cache.atomic_write", no_space)
    return monkeypatch


def test_a_full_cache_serves_uncached_and_warns_once(tmp_path, full_disk, caplog):
    cache = PlanCache(tmp_path / "cache")
    profile = load_profile("paper-8")
    graphs = [(FIXTURES / f"{name}.hapg").read_bytes() for name in ("mlp", "vgg19")]
    with caplog.at_level(logging.INFO, logger="hapd.cache"):
        served = [cache.compile(g, profile, CompileOptions()) for g in graphs]
        assert [s.path for s in served] == ["miss", "miss"]
        assert [s.not_cached for s in served] == [CACHE_FULL, CACHE_FULL]
        assert all(s.data and s.plan.estimate["per_iteration"] > 0 for s in served)
        assert cache.stats()["not_cached"] == 2 and cache.stats()["entries"] == 0
        full_disk.undo()  # space freed
        again = cache.compile(graphs[0], profile, CompileOptions())
    assert again.path == "miss" and again.not_cached is None
    assert cache.lookup(graphs[0], profile, CompileOptions()) is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"cache full: no space left in {tmp_path / 'cache'}; plans are served but not cached until space frees"]
    assert any("writes succeed again" in r.getMessage() for r in caplog.records)


def test_an_unwritable_cache_is_named_as_such(tmp_path, monkeypatch):
    def read_only(path, data, *, mode=0o666):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("hapd.serve.cache.atomic_write", read_only)
    cache = PlanCache(tmp_path / "cache")
    served = cache.compile((FIXTURES / "mlp.hapg").read_bytes(), load_profile("paper-8"), CompileOptions())
    assert served.not_cached == "cache not writable (Read-only file system)"
    assert served.data and cache.stats()["not_cached"] == 1


def test_a_daemon_on_a_full_tmpfs_compiles_anyway(tmp_path):
    """The cache folder is a 256 KiB tmpfs (in the daemon's own mount namespace), filled
    to the last byte once the daemon runs: API compiles and drops are served, the
    reply and the report say cache full, and the daemon warns once."""
    why = can_mount_tmpfs()
    if why:
        pytest.skip(why)
    home, cache = tmp_path / "hapd", tmp_path / "cache"
    cache.mkdir()
    wrap = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=256k tmpfs "{cache}" && exec "$@"', "sh"]
    with ServedDaemon(home, "--cache", str(cache), wrap=wrap) as daemon:
        inside = f"/proc/{daemon.pid}/root{cache}"  # the tmpfs as the daemon sees it
        wait_for(lambda: os.path.isdir(f"{inside}/plan"), GENEROUS_S, "the cache folders")
        with open(f"{inside}/filler", "wb", buffering=0) as filler:
            with pytest.raises(OSError) as info:
                for _ in range(1024):  # 4 MiB at most: far more than the tmpfs holds
                    filler.write(b"\0" * 4096)
            assert info.value.errno == errno.ENOSPC
        with daemon.client(timeout_s=GENEROUS_S) as client:
            for name in ("mlp", "vgg19"):
                reply = client.request("compile", {"graph": (FIXTURES / f"{name}.hapg").read_bytes(), "graph_kind": "hapg"}).body
                assert reply["cache"] == "miss" and reply["not_cached"] == CACHE_FULL and reply["plan"]
            assert client.status()["cache"]["not_cached"] >= 2
        staged = daemon.watch / ".incoming" / "vit.hapg"
        staged.write_bytes((FIXTURES / "vit.hapg").read_bytes())
        os.replace(staged, daemon.watch / "vit.hapg")
        wait_for(lambda: (daemon.watch / "done" / "vit.hapg").exists(), GENEROUS_S, "the drop to be done")
        assert (daemon.watch / "out" / "vit.hplan").is_file()
        assert "(not cached: cache full)" in (daemon.watch / "out" / "vit.report.txt").read_text()
        assert not list((daemon.watch / "failed").iterdir())
        log = daemon.log()
    assert log.count("cache full: no space left") == 1
    assert "internal error" not in log
