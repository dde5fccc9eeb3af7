"""The te-fusedadam-offload command (main), also as python -m te_fusedadam_offload."""

import signal
import sys

from .errors import EXIT_INTERRUPTED, interrupted_early, is_interrupt, quiet_lost_interrupts


def main():
    """The command line (cli.main). A Ctrl-C while the tool's modules are imported (a tenth of
    a second) stops it before it has read anything: one line, exit 130."""
    try:
        quiet_lost_interrupts()
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
