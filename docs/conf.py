"""Sphinx configuration for this repository's documentation (the page that goes upstream
with the series, built here to check that it renders without warnings)."""

project = "TransformerEngine FusedAdam state_dict CPU offload"
author = "the patch set's maintainers"
extensions = ["sphinx.ext.mathjax"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
