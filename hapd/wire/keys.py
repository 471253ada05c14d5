"""The state directory and the shared key file that authenticates control messages.

The daemon creates its key on first start: 32 random bytes written as 64 hex digits
to ``$HAPD_HOME/key`` with mode 0600, created with ``O_CREAT | O_EXCL`` so two daemons
starting together cannot both write one. Clients (``hapd.wire.client``, the launcher) read
the same file; to reach a daemon on another host, copy its key file there (mode 0600).
A key file that group or others can read is refused: anyone who can read it can start
processes through the daemon.

No torch import here: the client and the launcher use this module.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from hapd.errors import AuthError
from hapd.util import home_dir

KEY_BYTES = 32
"""Length of a key (HMAC-SHA256 keys of the hash's block output size)."""


def default_key_path() -> Path:
    """``$HAPD_KEY_FILE``, else ``<state directory>/key``."""
    env = os.environ.get("HAPD_KEY_FILE")
    return Path(env).expanduser() if env else home_dir() / "key"


def _check_mode(path: Path, fd: int) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise AuthError(f"key file {path} is not a regular file", field="key")
    if mode & 0o077:
        raise AuthError(
            f"key file {path} has mode {stat.S_IMODE(mode):04o}: group or others can read it; "
            f"run `chmod 600 {path}` (anyone who can read it can start processes through the daemon)",
            field="key",
        )


def _parse(path: Path, text: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise AuthError(f"key file {path} does not hold {KEY_BYTES * 2} hex digits", field="key")
    return key


def load_key(path: str | Path) -> bytes:
    """Read a key file (64 hex digits, mode 0600); raises :class:`AuthError` with the
    reason when it is missing, unreadable, malformed or readable by group/others."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise AuthError(
            f"no key file at {path}: start `hapd serve` once to create it, or copy the daemon's key file there",
            field="key",
        ) from None
    except OSError as exc:
        raise AuthError(f"cannot read key file {path}: {exc.strerror}", field="key") from exc
    try:
        _check_mode(path, fd)
        with os.fdopen(fd, "r", closefd=False) as handle:
            text = handle.read(4096)
    finally:
        os.close(fd)
    return _parse(path, text)


def load_or_create_key(path: str | Path) -> bytes:
    """The daemon's key: read ``path``, or create it if absent.

    Creation is atomic and exclusive: the key is written to a private temporary file
    (``O_CREAT | O_EXCL``, mode 0600), fsynced, then hard-linked to ``path``, which
    fails if another process created the key first (that key is then used). A reader
    never sees a half-written key."""
    path = Path(path).expanduser()
    if path.exists():
        return load_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it; be explicit anyway
            os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another daemon won the race: use its key
    finally:
        tmp.unlink(missing_ok=True)
    return load_key(path)
