"""Issue 17, item 3: every drop is answered, whatever its name. A drop ends in
``out/`` + ``done/`` or in ``failed/`` + an ``.error``, for names of every length a file
system takes (up to 255 bytes, multi-byte and non-UTF-8 ones included), and a symbolic
link or a FIFO dropped into the folder is answered with an error instead of being left
there silently. Real daemons and real files; waits are for files to appear."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _hardening_daemon import FIXTURES, ServedDaemon
from _wait import GENEROUS_S, wait_for

from hapd.serve.drops import NAME_MAX, OUT_SUFFIXES, bounded_name, out_stem, shown
from hapd.serve.watch import move_out, refusal_of
from hapd.util import atomic_write

pytestmark = pytest.mark.daemon

LONG_LENGTHS = list(range(220, NAME_MAX + 1))
"""Name lengths (with ``.hapg``) around the ones that went unanswered (235+ in the issue)."""
SHORT_LENGTHS = [6, 7, 50, 100, 200]


def _drop(watch: Path, name: str, data: bytes) -> None:
    staged = watch / ".incoming" / "staged.tmp"
    staged.write_bytes(data)
    os.replace(staged, watch / name)


def _names(tag: str) -> list[str]:
    return [tag * (n - len(".hapg")) + ".hapg" for n in SHORT_LENGTHS + LONG_LENGTHS]


def _answered_ok(watch: Path, name: str) -> bool:
    """In done/, and a report in out/ naming it (beside its plan)."""
    if not (watch / "done" / name).exists():
        return False
    stem = out_stem(Path(name).stem)
    report = watch / "out" / f"{stem}.report.txt"
    return report.is_file() and (watch / "out" / f"{stem}.hplan").is_file() and \
        report.read_text(errors="replace").startswith(f"drop:      {shown(name)}\n")


def _answered_error(watch: Path, name: str) -> bool:
    """In failed/, with an error file naming it."""
    error = watch / "failed" / bounded_name(name, ".error")
    return (watch / "failed" / name).exists() and error.is_file() and \
        error.read_text(errors="replace").startswith(f"{shown(name)}: ")


def _wait_answered(watch: Path, names: list[str], check) -> None:
    def all_answered() -> bool:
        return all(check(watch, n) for n in names)

    try:
        wait_for(all_answered, 3 * GENEROUS_S, f"{len(names)} drops to be answered")
    except AssertionError:
        missing = sorted(len(n) for n in names if not check(watch, n))
        raise AssertionError(f"unanswered drops of name lengths {missing}") from None


def test_names_of_every_length_are_answered(tmp_path):
    """A good graph under names of 6..255 characters: each gets its plan and report in
    out/ and is moved to done/; garbage under the same lengths gets failed/ + .error.
    Nothing is left in the folder and nothing is retried."""
    good = _names("v")
    bad = _names("g")
    with ServedDaemon(tmp_path / "hapd") as daemon:
        for name in good:
            _drop(daemon.watch, name, (FIXTURES / "mlp.hapg").read_bytes())
        for name in bad:
            _drop(daemon.watch, name, (FIXTURES / "garbage.hapg").read_bytes())
        _wait_answered(daemon.watch, good, _answered_ok)
        _wait_answered(daemon.watch, bad, _answered_error)
        assert not [p for p in daemon.watch.iterdir() if p.name.endswith(".hapg")]
        with daemon.client() as client:
            drops = client.status()["drops"]
        assert (drops["done"], drops["failed"]) == (len(good), len(bad))
        assert "cannot move" not in daemon.log() and "Errno 36" not in daemon.log()


def test_multibyte_and_undecodable_names_are_answered(tmp_path):
    """255 bytes of two-byte characters, and a name that is not UTF-8."""
    wide = "é" * ((NAME_MAX - len(".hapg")) // 2) + ".hapg"
    assert len(os.fsencode(wide)) <= NAME_MAX
    raw = os.fsdecode(b"bad\xff\xfename.hapg")
    with ServedDaemon(tmp_path / "hapd") as daemon:
        _drop(daemon.watch, wide, (FIXTURES / "mlp.hapg").read_bytes())
        _drop(daemon.watch, raw, (FIXTURES / "garbage.hapg").read_bytes())
        _wait_answered(daemon.watch, [wide], _answered_ok)
        _wait_answered(daemon.watch, [raw], _answered_error)
        with daemon.client() as client:  # the worker survived both
            assert client.status()["drops"]["failed"] == 1


def test_a_symlink_is_answered_not_followed(tmp_path):
    """A symbolic link dropped into the folder is moved to failed/ (the link itself,
    its target untouched and never read) with an error that says why; so is a FIFO."""
    target = tmp_path / "elsewhere.hapg"
    target.write_bytes((FIXTURES / "mlp.hapg").read_bytes())
    with ServedDaemon(tmp_path / "hapd") as daemon:
        (daemon.watch / "link.hapg").symlink_to(target)
        os.mkfifo(daemon.watch / "pipe.hapg")
        wait_for(lambda: (daemon.watch / "failed" / "link.hapg.error").is_file(), GENEROUS_S, "the symlink's error")
        wait_for(lambda: (daemon.watch / "failed" / "pipe.hapg.error").is_file(), GENEROUS_S, "the FIFO's error")
        error = (daemon.watch / "failed" / "link.hapg.error").read_text()
        assert error.startswith("link.hapg: not read: a symbolic link") and "not followed" in error
        assert "a FIFO: only regular files are read" in (daemon.watch / "failed" / "pipe.hapg.error").read_text()
        wait_for(lambda: (daemon.watch / "failed" / "link.hapg").is_symlink(), GENEROUS_S, "the link to be moved")
        assert not (daemon.watch / "link.hapg").exists() and not (daemon.watch / "link.hapg").is_symlink()
        assert os.readlink(daemon.watch / "failed" / "link.hapg") == str(target)
        assert target.read_bytes() == (FIXTURES / "mlp.hapg").read_bytes()
        assert not list((daemon.watch / "out").iterdir())


# ----------------------------------------------------------------------------- names


def test_bounded_name_keeps_short_names_and_cuts_long_ones():
    assert bounded_name("model.hapg", ".error") == "model.hapg.error"
    long = "a" * 250 + ".hapg"
    cut = bounded_name(long, ".error")
    assert len(os.fsencode(cut)) == NAME_MAX and cut.endswith(".error") and "~" in cut
    assert cut != bounded_name("a" * 250 + ".pt2x", ".error")  # the tag tells long names apart
    wide = "é" * 127 + ".hapg"
    assert len(os.fsencode(bounded_name(wide, ".error"))) <= NAME_MAX
    assert bounded_name(wide, ".error").encode()  # cut on a character boundary: still UTF-8


def test_out_stem_fits_every_out_file():
    for length in (1, 100, 240, 250):
        stem = out_stem("s" * length)
        for suffix in OUT_SUFFIXES:
            assert len(os.fsencode(stem + suffix)) <= NAME_MAX
    assert out_stem("short") == "short"


def test_atomic_write_of_a_name_at_the_limit(tmp_path):
    """The temporary sibling of a 255-byte name fits too (it used to fail with ENAMETOOLONG)."""
    path = tmp_path / ("n" * NAME_MAX)
    atomic_write(path, b"x")
    assert path.read_bytes() == b"x" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_move_out_of_a_name_at_the_limit_and_of_a_link(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    long = src / ("m" * NAME_MAX)
    long.write_bytes(b"y")
    move_out(long, dst)
    assert (dst / long.name).read_bytes() == b"y" and not long.exists()
    link = src / "l.hapg"
    link.symlink_to(tmp_path / "nowhere")
    move_out(link, dst)
    assert (dst / "l.hapg").is_symlink() and not link.is_symlink()
    assert not [p for p in dst.iterdir() if p.name.endswith(".tmp")]


def test_refusal_of_file_types():
    import stat

    assert refusal_of(stat.S_IFREG | 0o644) is None
    assert "symbolic link" in refusal_of(stat.S_IFLNK | 0o777)
    assert refusal_of(stat.S_IFIFO | 0o644).startswith("a FIFO")


def test_a_drop_that_cannot_be_moved_is_answered_once(tmp_path, monkeypatch, caplog):
    """When the file system refuses the move out of the folder, the drop is answered
    (its error written) and said to stay, once: the rescan's later hand-overs of the
    unchanged file are not answered, or logged, again."""
    import hapd.serve.drops as drops_mod
    from hapd.compiler.options import CompileOptions
    from hapd.profile.schema import load_profile
    from hapd.serve.cache import PlanCache
    from hapd.serve.drops import SUBFOLDERS, DropProcessor
    from hapd.serve.watch import Drop, signature

    folder = tmp_path / "watch"
    for sub in SUBFOLDERS:
        (folder / sub).mkdir(parents=True)
    processor = DropProcessor(folder, cache=PlanCache(tmp_path / "cache"), profile=load_profile("paper-8"),
                              options=CompileOptions(), relp=True, lower=lambda data: data, on_ready=lambda d: None,
                              settle_s=0.0, rescan_s=1.0)
    bad = folder / "bad.hapg"
    bad.write_bytes((FIXTURES / "garbage.hapg").read_bytes())

    def refuse(path, dest):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(drops_mod, "move_out", refuse)
    with caplog.at_level("INFO", logger="hapd.drops"):
        for _ in range(3):  # three rescans hand the same file over
            processor.process(Drop(bad, signature(os.stat(bad))))
    assert (folder / "failed" / "bad.hapg.error").is_file() and bad.exists()
    assert processor.failed == 1
    assert sum("cannot move bad.hapg" in r.getMessage() for r in caplog.records) == 1
