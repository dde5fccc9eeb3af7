"""Where the series and the pin live: the repository checkout, or the installed package."""

from pathlib import Path

_PACKAGE_DATA = Path(__file__).resolve().parent / "_data"
_REPO = Path(__file__).resolve().parent.parent


def repo_root():
    """The repository checkout this tool runs from, or None when it runs installed."""
    if (_REPO / "series.toml").is_file() and (_REPO / "te_fusedadam_offload").is_dir():
        return _REPO
    return None


def data_file(name):
    """A data file (upstream.json, series.toml) or directory (patches) of the series."""
    root = repo_root()
    path = (root / name) if root is not None else (_PACKAGE_DATA / name)
    if not path.exists():
        raise FileNotFoundError(f"{name} not found at {path}")
    return path
