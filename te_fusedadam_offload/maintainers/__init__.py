"""The maintainers' side of the tool: the commands that make and check the series itself
(commands.py: fetch, materialize, refresh, drift, check-main, lint, pr) and their engines
(generate.py: patches/ from the materialized trees; drift.py: the series against each
release; mainline.py: the pinned upstream main tree and the stack on it; review.py: TE's lint
job and the sign-off). They work in a checkout of the repository (python -m
te_fusedadam_offload COMMAND); the users' commands (cli.py) need none of them."""

from .commands import MAINTAINERS_COMMANDS, add_commands

__all__ = ["MAINTAINERS_COMMANDS", "add_commands"]
