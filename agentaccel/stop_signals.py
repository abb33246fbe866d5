"""Ctrl-C and the stop signal, for the helper processes a server starts (the recorder's writer, the
store's pruner). A terminal's Ctrl-C (SIGINT) and systemd's stop (SIGTERM to the whole control
group) reach every process of the server's group, helpers too; stopping a helper is the server's
job (it closes the helper's pipe and the helper finishes what it holds), so helpers ignore both.

A helper can only ignore them once its own code runs, and starting a Python process takes seconds
on a loaded machine (the interpreter, then the imports that unpickling its arguments needs). A
signal in that window killed the recorder's writer half-started, with the calls already sent to
its pipe. So a helper is started with both signals blocked (a blocked signal waits, pending; the
mask is inherited across fork and exec), and unblocks them after it has set them to be ignored,
which drops any that came meanwhile. The server itself still takes them: only the thread that
starts the helper blocks them, for the moment it takes.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def held_for_a_helper() -> Iterator[None]:
    """Around starting a helper process: this thread blocks the stop signals, so the helper starts
    with them blocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignored_in_this_helper() -> None:
    """First thing in a helper process: the stop signals are ignored from now on; any that arrived
    while it started (held back by `held_for_a_helper`) are dropped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
