"""Errors the tool reports to its user."""


class ToolError(Exception):
    """A failure with a message for the user; the command exits with status 1."""
