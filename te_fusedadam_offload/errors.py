"""Errors the tool reports to its user, each with the exit status of its kind; and the hook
with which the crash tests make a run fail at a chosen point."""

import errno
import os
import signal
import sys

# Exit statuses (also in the README and in `--help`).
EXIT_NO = 1  # the answer is no: not applied, drifted, a failed check; or a run that failed
EXIT_USAGE = 2  # bad arguments (argparse)
EXIT_NO_TARGET = 3  # no TE where named: no such directory, no transformer_engine/ in it
EXIT_NEEDS = 4  # something the tool needs is missing or unreachable: git, a Python, the network
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT), after saying what the files are

# The table of `te-fusedadam-offload --help` (once: a command's help points at it).
EXIT_CODES = f"""exit status:
  0  success (status, check: the series is applied)
  {EXIT_NO}  no: the series is not in: not applied, interrupted or drifted (status, check: a CI
     line runs 'te-fusedadam-offload check && train'); refused or stopped (apply, revert: the
     message says what the files are); a failed check (maintainers)
  {EXIT_USAGE}  bad arguments; a maintainers' command outside a checkout of the repository
  {EXIT_NO_TARGET}  no TE where named: no such directory, no transformer_engine/ in it, none
     installed in the Python, or only what apply saved left by an uninstall of TE
  {EXIT_NEEDS}  something the tool needs is missing or unreachable: git, the Python of
     --python, the package index
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C), after one line saying what the files are
  141  the reader of the output went away (status | head -1)"""


class ToolError(Exception):
    """A failure with a message for the user; the command exits with `code` (1 by default)."""

    code = EXIT_NO


class UsageError(ToolError):
    """Arguments that the parser cannot check: the command exits with status 2."""

    code = EXIT_USAGE


class NoTargetError(ToolError):
    """No TE where the user pointed: the command exits with status 3."""

    code = EXIT_NO_TARGET


class NeedsError(ToolError):
    """Something the tool needs (git, another Python, the package index) is missing or
    unreachable: the command exits with status 4."""

    code = EXIT_NEEDS


def interrupted_early(argv):
    """The line of a command stopped by Ctrl-C before it found its TE (`argv`: its arguments)."""
    name = " ".join(["te-fusedadam-offload", *[a for a in argv[:1] if a[:1] != "-"]])
    return f"{name}: interrupted before it read the TE; nothing was changed"


def is_interrupt(exc):
    """Whether `exc` is a Ctrl-C: a KeyboardInterrupt, the RuntimeError that Python 3.11 and
    older raise in its place when it lands in a class's ``__set_name__`` (seen while a module of
    the standard library was imported: ``Error calling __set_name__ ...``, caused by it), or an
    OSError raised while a Ctrl-C was being handled (seen: ``Bad file descriptor`` from
    shutil.rmtree of a TemporaryDirectory, which the Ctrl-C had stopped halfway)."""
    return (
        isinstance(exc, KeyboardInterrupt)
        or (isinstance(exc, RuntimeError) and isinstance(exc.__cause__, KeyboardInterrupt))
        or (
            isinstance(exc, OSError)
            and exc.errno == errno.EBADF
            and isinstance(exc.__context__, KeyboardInterrupt)
        )
    )


def quiet_lost_interrupts():
    """A Ctrl-C that lands in a callback that Python cannot raise from (a weakref callback of
    the import system, seen when it came while a module was imported) is lost: Python prints
    "Exception ignored in ..." with a traceback and the command goes on. Print nothing for it
    (the command then ends as if Ctrl-C came after its work); other such errors as before.
    Returns the hook it replaced."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)

    sys.unraisablehook = hook
    return previous


# The crash tests' hook (tests/tool/test_crash_safety.py): a failure at a chosen point of a run.
FAULT_ENV = "TE_FUSEDADAM_OFFLOAD_FAULT"
_fault_counts = {}


def fault(point):
    """Test hook. With TE_FUSEDADAM_OFFLOAD_FAULT=POINT[#N]:ACTION the N-th time (default: the
    first) that the tool reaches POINT it kills itself (ACTION "kill", SIGKILL), is interrupted
    as by Ctrl-C ("int": SIGINT to its process group where it leads one, as a terminal sends
    it, git included; else to itself) or fails as a full or broken disk would ("enospc",
    "eio"). Points: "lock" (the target found, before its lock is taken), "scratch" (a scratch
    copy of the target's files made, in $TMPDIR), "git" (a git process started), "write" (half
    of a new file written), "replace" (a new file written and synced, before it replaces the
    old one), "unlink" (before the saved originals are removed), "done" (apply's or revert's
    work done and read back, before the line that says it succeeded)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    where, _, action = spec.partition(":")
    name, _, nth = where.partition("#")
    if name != point:
        return
    _fault_counts[point] = _fault_counts.get(point, 0) + 1
    if _fault_counts[point] != int(nth or 1):
        return
    if action == "int" and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGINT)
        return
    if action in ("kill", "int"):
        os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGINT)
        return
    code = {"enospc": errno.ENOSPC, "eio": errno.EIO}[action]
    raise OSError(code, os.strerror(code))
