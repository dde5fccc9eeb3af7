"""Sphinx configuration for building TE's own docs (of a patched TE source tree) where doxygen
is not installed: TE's docs/conf.py, with breathe's doxygenfile directive (the C API pages,
made from doxygen's XML) rendering nothing and the notebooks rendered from their stored
outputs. Everything else is TE's configuration; pandoc must be on PATH for nbsphinx.

    TE_DOCS=te-main/docs sphinx-build -W -b html -c qa/te_docs te-main/docs /tmp/te-docs-html
"""

import collections
import os
import runpy

from docutils.parsers.rst import Directive, directives

_TE_DOCS = os.path.abspath(os.environ["TE_DOCS"])
globals().update(
    {
        k: v
        for k, v in runpy.run_path(os.path.join(_TE_DOCS, "conf.py")).items()
        if not k.startswith("__")
    }
)
# pylint: disable=undefined-variable,used-before-assignment
extensions = [e for e in extensions if e != "breathe"]
nbsphinx_execute = "never"
# Relative to TE's docs directory, not to this one.
templates_path = [os.path.join(_TE_DOCS, p) for p in templates_path]
html_static_path = [os.path.join(_TE_DOCS, p) for p in html_static_path]


class _NoDoxygen(Directive):
    """Stands in for breathe's doxygenfile: renders nothing."""

    optional_arguments = 1
    final_argument_whitespace = True
    has_content = True
    option_spec = collections.defaultdict(lambda: directives.unchanged)

    def run(self):
        return []


_te_setup = globals().get("setup")


def setup(app):
    """TE's setup, and the stand-in for doxygenfile."""
    if _te_setup is not None:
        _te_setup(app)
    app.add_directive("doxygenfile", _NoDoxygen)
