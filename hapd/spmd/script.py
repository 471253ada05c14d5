"""The runner of a user's script on a rank: ``python -m hapd.spmd.script SCRIPT ARGS…``.

The daemon starts every rank of a plain launch so. It runs ``SCRIPT`` as ``python
SCRIPT ARGS…`` would — ``__name__ == "__main__"``, ``sys.argv``, the script's folder
first on ``sys.path``, an uncaught exception printed by ``sys.excepthook`` and status 1,
``sys.exit``'s status kept — and then ends the process with
:func:`hapd.util.exit_process` rather than the interpreter's finalization. A script that
trained, reported and returned with its Gloo group alive can otherwise abort during
finalization (SIGABRT, status 134, "terminate called without an active exception"),
rarely and only on a busy host, and the launcher would report a finished run as failed.

Torch-free: the runner imports nothing of torch before the script, whose own settings
(``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, …) come first. The in-place runner of
elastic jobs (:mod:`hapd.elastic.in_place`) runs the script with the same pieces.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from hapd.util import exit_process

SCRIPT_MODULE = "hapd.spmd.script"
"""What a plain launch's ranks run the script under (``python -m`` it)."""


def run_script(script: str, args: list[str]) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *args]`` and its folder
    first on ``sys.path``, as the interpreter runs a script it is given."""
    sys.argv = [script, *args]
    folder = str(Path(script).resolve().parent)
    if not sys.path or sys.path[0] != folder:
        sys.path.insert(0, folder)
    runpy.run_path(script, run_name="__main__")


def exit_status(code: object) -> int:
    """The status a ``SystemExit(code)`` ends the interpreter with: ``None`` is 0, an
    int is itself, anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr, flush=True)
    return 1


def report_exception(exc: BaseException) -> None:
    """Print an uncaught exception with ``sys.excepthook`` (the user's, if the script set
    one), its traceback starting at the script: the runner's and runpy's frames are left
    out, as ``python SCRIPT`` shows none of them."""
    runner_files = {__file__, runpy.__file__, "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in runner_files:
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints the exception's own traceback


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"usage: python -m {SCRIPT_MODULE} SCRIPT [ARGS…]", file=sys.stderr)
        return 2
    try:
        run_script(argv[0], argv[1:])
    except SystemExit as exc:
        return exit_status(exc.code)
    except KeyboardInterrupt as exc:
        report_exception(exc)
        return 130
    except BaseException as exc:  # noqa: BLE001 - the script's uncaught exception, told as Python tells it
        report_exception(exc)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
