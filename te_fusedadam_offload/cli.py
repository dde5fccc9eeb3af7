"""te-fusedadam-offload: the command line of the patch set; the users' commands (apply,
status, check, revert), then the maintainers' (maintainers.py)."""

import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile

from .actions import apply, carry_out, locked, revert
from .arguments import parser
from .errors import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ToolError,
    fault,
    interrupted_early,
    is_interrupt,
    quiet_lost_interrupts,
)
from .maintainers import MAINTAINERS_COMMANDS
from .paths import repo_root
from .plan import tidying
from .preview import dry_run, would_apply
from .report import file_report, status_json, status_lines
from .series import stack_prefix
from .state import APPLIED, NOT_APPLIED, NOT_FOR_TARGET, State
from .target import find_target


def _target(args, changes=False):
    """The target of the command, locked for it (actions.locked) until the command ends:
    exclusively for one that `changes` it (apply, revert), shared for one that reads it."""
    args.target = find_target(args.path, args.installed, args.python)

    def waiting():
        args.waited = True

    args.stack.enter_context(locked(args.target, changes, args.command, waiting))
    args.locked = True
    return args.target


def _print_status(state):
    print(f"{state.target}: {state.overall}")
    for name, what, detail in state.rows:
        if what == NOT_FOR_TARGET:  # tests and docs: for a source checkout only; --json has them
            continue
        print(f"  {name}: {what}" + (f" ({detail})" if detail else ""))
    return state.overall


def cmd_status(args):
    """Tell whether the series is applied, not applied, interrupted or drifted, per patch and
    file. Exit 0 if it is applied, 1 otherwise."""
    try:
        state = State(_target(args))
    except ToolError as exc:  # with --json, the error as JSON too; the exit status is kept
        if args.json:
            print(json.dumps({"error": str(exc), "exit_status": exc.code}, indent=2))
        raise
    if args.json:
        report = status_json(state)
        print(json.dumps(report, indent=2))
        return 0 if report["status"] == APPLIED else 1
    overall = _print_status(state)
    for line in status_lines(state, overall):
        print(line)
    return 0 if overall == APPLIED else 1


def cmd_check(args):
    """Verify that the series is in, as a CI line does before training (te-fusedadam-offload
    check && train): exit 0 if it is applied, 1 if it is not (not applied, interrupted,
    drifted), with one line on what apply would do. apply --dry-run tells whether apply would
    succeed."""
    state = State(_target(args))
    overall = _print_status(state)
    print(f"  apply: {would_apply(state)}")
    return 0 if overall == APPLIED else 1


def cmd_apply(args):
    """Apply the series (idempotent, all or nothing); with --dry-run, show what it would
    change and change nothing."""
    target, patches = _target(args, changes=not args.dry_run), stack_prefix(args.upto)
    if args.dry_run:
        message, diff = dry_run(State(target, patches, "apply"))
        sys.stdout.write(diff)
        print(f"dry run: {target}: apply would say: {message}; nothing was changed")
        return
    message = apply(target, patches)
    overall = State(target, patches).overall
    if overall != APPLIED:
        raise ToolError(f"after applying, the series reads as {overall}")
    _done(f"{target}: {message}")


def cmd_revert(args):
    """Take the series out, restoring the exact files it changed."""
    target = _target(args, changes=True)
    message = revert(target, args.discard_edits)
    files = [f"  {rel}: {what}" for rel, what in file_report(State(target), NOT_APPLIED)]
    _done(f"{target}: {message}", *files)


def _done(*lines):
    """Print the lines that say a command changing files succeeded, once its work is done and
    read back: a Ctrl-C before them is reported as an interrupt (exit 130), one from here on is
    ignored, so that a success line is never followed by one."""
    fault("done")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for line in lines:
        print(line)


def build_parser(maintainers=None):
    """The argument parser (arguments.py): the users' commands, then, in a checkout of the
    patch set's repository (or with `maintainers`), those for maintainers of the series."""
    users = [("apply", cmd_apply), ("status", cmd_status), ("check", cmd_check)]
    users.append(("revert", cmd_revert))
    return parser(users, repo_root() is not None if maintainers is None else maintainers)


def _on_sigint(signum, frame):  # pylint: disable=unused-argument
    """The first Ctrl-C stops the command; later ones are ignored while it says what it left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _interrupted(args):
    """The line that an interrupted command prints: what the files are, read back (with
    Ctrl-C ignored; git run for it ignores it too)."""
    target = args.target
    if args.command not in ("apply", "revert") or getattr(args, "dry_run", False):
        return f"interrupted; nothing was changed ({args.command} only reads)"
    if getattr(args, "waited", False) and not getattr(args, "locked", False):
        return "interrupted while it waited for another run on the TE; nothing was changed"
    if not getattr(args, "locked", False):  # found, but not yet locked: nothing read
        return "interrupted before it read the TE; nothing was changed"
    try:
        state = State(target)
        if target.kind != "checkout":
            carry_out(tidying(state))  # what the next apply or revert would remove first
        files = "; ".join(f"{rel}: {what}" for rel, what in file_report(state))
        return f"interrupted; {files} (status: {state.overall})"
    except ToolError as exc:
        return f"interrupted; {str(exc).splitlines()[0]}"


def _run(args):
    """The command of `args`; its exit status."""
    try:
        with (
            contextlib.redirect_stdout(io.StringIO())
            if getattr(args, "quiet", 0)
            else contextlib.nullcontext()
        ):
            code = args.func(args) or 0
        sys.stdout.flush()  # here, so that a closed pipe is caught below
        return code
    except ToolError as exc:
        sys.stdout.flush()
        print(f"te-fusedadam-offload {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # The reader of our output went away (`status | head -1`): stop quietly, and keep the
        # interpreter from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def main(argv=None, command=False):
    """Entry point; returns the exit status (EXIT_CODES). Scratch copies go into a directory
    of this run in $TMPDIR, removed at the end, also after Ctrl-C, which ends the command with
    one line saying what the files are (exit 130). As the command (`command`, __main__.py),
    a Ctrl-C after the work is done is ignored: the exit status is that of the work."""
    # Ctrl-C is held back until the handler is in place and the scratch directory is known,
    # so that it is removed (as the command, __main__.py has held it back since its import).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous, unraisable = signal.getsignal(signal.SIGINT), quiet_lost_interrupts()
    if previous is not signal.SIG_IGN:  # as Python does, a SIGINT ignored at start stays so
        signal.signal(signal.SIGINT, _on_sigint)
    tempdir = tempfile.tempdir
    scratch = tempfile.tempdir = tempfile.mkdtemp(prefix="te-fusedadam-offload-")
    args = None
    lock = contextlib.ExitStack()  # the target's lock, held until what it left is said
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        given = sys.argv[1:] if argv is None else argv
        if repo_root() is None and given and given[0] in MAINTAINERS_COMMANDS:
            print(
                f"te-fusedadam-offload: error: {given[0]} is a command for the maintainers of "
                "the series; it works in a checkout of the patch set's repository (python -m "
                f"te_fusedadam_offload {given[0]} there)",
                file=sys.stderr,
            )
            return EXIT_USAGE
        args = build_parser().parse_args(argv)
        args.stack = lock
        code = _run(args)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the work is done: a Ctrl-C from here on
        return code  # is ignored (one just before is raised here, in the try)
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        if not is_interrupt(exc):
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if getattr(args, "target", None) is None:
            print(interrupted_early(sys.argv[1:] if argv is None else argv), file=sys.stderr)
        else:
            print(f"te-fusedadam-offload {args.command}: {_interrupted(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        lock.close()
        shutil.rmtree(scratch, ignore_errors=True)
        tempfile.tempdir = tempdir
        if not command:
            signal.signal(signal.SIGINT, previous)
            sys.unraisablehook = unraisable
