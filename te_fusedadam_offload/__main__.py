"""The te-fusedadam-offload command (main), also as python -m te_fusedadam_offload."""

import signal
import sys

from .errors import EXIT_INTERRUPTED, interrupted_early, is_interrupt, quiet_lost_interrupts


def _ctrl_c_before_main():
    """Whether Python caught a Ctrl-C before this entry point ran, and went on. Started with a
    script's path (as the installed command is), Python checks whether that path is an import
    path entry; a Ctrl-C there is printed ("Failed checking if argv[0] is an import path entry"
    and its traceback) and the script runs all the same. Python keeps what it printed as
    sys.last_value (and sys.last_exc from 3.12)."""
    caught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(caught, KeyboardInterrupt)


def main():
    """The command line (cli.main). A Ctrl-C while the tool's modules are imported (a tenth of
    a second), or one that Python printed at its start and went on, stops it before it has
    read anything: one line, exit 130."""
    try:
        quiet_lost_interrupts()
        if _ctrl_c_before_main():
            raise KeyboardInterrupt
        from .cli import main as cli_main  # pylint: disable=import-outside-toplevel

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # until cli.main's handler
    except (KeyboardInterrupt, RuntimeError, OSError) as exc:
        if not is_interrupt(exc):
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(interrupted_early(sys.argv[1:]), file=sys.stderr)
        return EXIT_INTERRUPTED
    return cli_main(command=True)


if __name__ == "__main__":
    sys.exit(main())
