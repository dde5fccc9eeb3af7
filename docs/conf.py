"""Sphinx configuration for this repository's documentation (the page that goes upstream
with the series, built here to check that it renders without warnings; CheckpointStager's
reference from its docstrings)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # te_fusedadam_offload

project = "TransformerEngine FusedAdam state_dict CPU offload"
author = "the patch set's maintainers"
extensions = ["sphinx.ext.mathjax", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
exclude_patterns = ["_build"]
html_theme = "alabaster"
