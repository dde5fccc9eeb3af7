"""Try the series against other TE releases from the package index."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import NeedsError
from ..patching import failure, offsets
from ..series import patch_label
from ..state import NOT_CHECKED, State
from ..target import Target, older_than_supported, supported_range, version_key
from ..upstream import cache_dir, download_wheel, load_pin, sha256_of, unpack_subtree

CLEAN, OFFSET, CONFLICT = "applies cleanly", "applies with offset", "conflicts"


def released_versions(package):
    """Versions of `package` on the package index, newest first."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"Available versions: (.+)", result.stdout)
    if result.returncode != 0 or not m:
        raise NeedsError(
            f"could not list the releases of {package}; is the network reachable?\n"
            f"{result.stderr.strip()}"
        )
    return [v.strip() for v in m.group(1).split(",") if v.strip()]


def default_versions():
    """Every release the series supports (from the oldest supported on) and the newest."""
    pin = load_pin()
    oldest = version_key(supported_range()[0])
    released = [v for v in released_versions(pin["package"]) if re.fullmatch(r"[\d.]+", v)]
    chosen = [v for v in released if version_key(v) >= oldest]
    if pin["version"] not in chosen:
        chosen.append(pin["version"])
    return sorted(chosen, key=version_key)


def check_tree(root):
    """[(patch, result, detail)] for the series (after the compat patch that the tree needs,
    if any) against a tree holding transformer_engine/, applied in order to a scratch copy."""
    state = State(Target(root, "tree"))
    relevant = state.relevant
    rows = {patch_label(p): (NOT_CHECKED, "an earlier patch conflicts") for p in relevant}
    for patch, result in state.forward[0]:
        if result.returncode != 0:
            rows[patch_label(patch)] = (CONFLICT, failure(result, patch))
        elif offsets(result):
            rows[patch_label(patch)] = (OFFSET, "; ".join(offsets(result)))
        else:
            rows[patch_label(patch)] = (CLEAN, "")
    return [(patch_label(p), *rows[patch_label(p)]) for p in relevant]


def drift(versions=None):
    """Yield (version, wheel sha256, rows, note) for each release tried, in turn; a release
    that cannot be downloaded gets sha256 None and a row that says why, and the others are
    still tried."""
    pin = load_pin()
    oldest, pinned = supported_range()
    for version in versions or default_versions():
        try:
            wheel = download_wheel(pin["package"], version, cache_dir() / "wheels")
        except NeedsError as exc:
            yield version, None, [("download", NOT_CHECKED, str(exc).replace("\n", " "))], ""
            continue
        note = ""
        if older_than_supported(version):
            note = (
                f"older than the releases the series supports (TE {oldest} to {pinned}): "
                "apply refuses it"
            )
        with tempfile.TemporaryDirectory() as tmp:
            unpack_subtree(wheel, pin["subtree"], Path(tmp))
            yield version, sha256_of(wheel), check_tree(tmp), note
