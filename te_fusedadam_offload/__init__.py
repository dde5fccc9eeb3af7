"""Materialize, apply, check, revert and refresh the FusedAdam state_dict CPU offload series
for NVIDIA TransformerEngine."""

__version__ = "0.1.0"
