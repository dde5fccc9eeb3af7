"""The command line's arguments: the users' commands (apply, status, check, revert; cli.py
runs them), how each names its target, and their options; in a checkout of the patch set's
repository, the maintainers' commands too (maintainers/)."""

import argparse
import textwrap

from . import __version__
from .errors import EXIT_CODES
from .maintainers import add_commands
from .upstream import load_pin


def parser(users, maintainers):
    """The argument parser: the commands for users (`users`: [(name, function)], whose
    docstring is its help), then, with `maintainers` (in a checkout of the patch set's
    repository), those for maintainers of the series."""
    top = argparse.ArgumentParser(
        prog="te-fusedadam-offload",
        description=(
            "Apply, check and revert the FusedAdam state_dict_cpu_offload patch series on a\n"
            "TransformerEngine: the one installed in this Python (the default), the one of\n"
            "another Python (--python), a source checkout, or a directory holding\n"
            "transformer_engine/."
            + (
                " The commands marked [maintainers] make and check the series\nitself, in a "
                "checkout of its repository."
                if maintainers
                else ""
            )
        ),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pin = load_pin()
    top.add_argument(
        "--version",
        action="version",
        version=(
            f"%(prog)s {__version__} (the series for TE {pin['version']}, made against TE main "
            f"{pin['main']['commit'][:9]})"
        ),
    )
    quiet = (
        "print nothing on standard output: the exit status tells (errors still go to standard "
        "error)"
    )
    top.add_argument("-q", "--quiet", action="store_true", help=quiet)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(" ".join(help_text.split()), 80),
            epilog="exit status: 0 success; the others are listed by te-fusedadam-offload --help",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=func)
        return p

    for name, func in users:
        p = add(name, func, func.__doc__)
        group = p.add_mutually_exclusive_group()
        group.add_argument(
            "path",
            nargs="?",
            help="a TE source checkout or a directory holding transformer_engine/",
        )
        group.add_argument(
            "--installed",
            action="store_true",
            help="the TE installed in this Python environment (the default without a path)",
        )
        group.add_argument(
            "--python",
            metavar="PYTHON",
            help=(
                "the TE installed in the environment of this Python interpreter (for a "
                "tool installed elsewhere, e.g. with pipx): --python /path/to/venv/bin/python"
            ),
        )
        # Before or after the command; here without a default, which would undo one before.
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=quiet)
        if name == "apply":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="print the diff that apply would make, and change nothing",
            )
            p.add_argument(
                "--upto",
                type=int,
                metavar="N",
                help=(
                    "[maintainers] only the first N pull requests of the stack (to test them "
                    "alone); a later apply without it replaces them with the whole stack"
                ),
            )
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the report as JSON")
        if name == "revert":
            p.add_argument(
                "--discard-edits",
                action="store_true",
                help=(
                    "also write the saved original back over a file that was changed after "
                    "apply patched it (that change is lost; revert names the file)"
                ),
            )

    if maintainers:
        add_commands(add)
    return top
