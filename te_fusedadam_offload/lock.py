"""One command at a time on a target: apply and revert hold an exclusive lock on the target's
transformer_engine/ directory, the reading commands a shared one.

The lock is flock(2) on the directory itself, opened read-only: it needs no write access (a
read-only site-packages is read all the same), leaves no file behind, is seen by every process
on the machine whatever venv its tool runs from, and goes with the process: a run that is
killed holds it no longer. So when every rank of a node runs `apply --installed` at once, one
applies the series and the others wait for it and find it applied."""

import contextlib
import fcntl
import os
import sys

from .errors import fault


@contextlib.contextmanager
def locked(target, exclusive, command, waiting=None):
    """Hold the lock of `target` (exclusive: apply, revert; else shared) for the block. Waits
    for a run that holds it, saying so on standard error once; `waiting`, if given, is called
    first (so that a Ctrl-C while it waits is told from one before it took a free lock)."""
    directory = target.root / target.subtree
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        fault("lock")
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            print(
                f"te-fusedadam-offload {command}: waiting for another te-fusedadam-offload run "
                f"on {directory} to finish",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, kind)
        yield
    finally:
        os.close(fd)  # releases the lock
