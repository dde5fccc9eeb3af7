"""Try the series against other TE releases from the package index."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import ToolError
from .series import patch_label
from .target import NOT_CHECKED, Target, _failure, has_offset, relevant_patches, simulate
from .upstream import cache_dir, download_wheel, load_pin, sha256_of, unpack_subtree

CLEAN, OFFSET, CONFLICT = "applies cleanly", "applies with offset", "conflicts"


def released_versions(package):
    """Versions of `package` on the package index, newest first."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"Available versions: (.+)", result.stdout)
    if result.returncode != 0 or not m:
        raise ToolError(
            f"could not list the releases of {package}; is the network reachable?\n"
            f"{result.stderr.strip()}"
        )
    return [v.strip() for v in m.group(1).split(",") if v.strip()]


def default_versions():
    """The pinned release, the other patch releases of its minor series, and the newest."""
    pin = load_pin()
    released = [v for v in released_versions(pin["package"]) if re.fullmatch(r"[\d.]+", v)]
    minor = ".".join(pin["version"].split(".")[:2]) + "."
    chosen = [v for v in released if v.startswith(minor)]
    if released and released[0] not in chosen:
        chosen.insert(0, released[0])
    if pin["version"] not in chosen:
        chosen.append(pin["version"])
    return chosen


def check_tree(root):
    """[(patch, result, detail)] for the series against a tree holding transformer_engine/,
    applied in order to a scratch copy."""
    target = Target(root, "tree")
    relevant = relevant_patches(target)
    rows = {patch_label(p): (NOT_CHECKED, "an earlier patch conflicts") for p in relevant}
    for patch, result in simulate(target, relevant):
        if result.returncode != 0:
            rows[patch_label(patch)] = (CONFLICT, _failure(result, patch))
        elif has_offset(result):
            offsets = re.findall(
                r"Hunk #\d+ succeeded at \d+ \(offset -?\d+ lines?\)", result.stderr
            )
            rows[patch_label(patch)] = (OFFSET, "; ".join(offsets))
        else:
            rows[patch_label(patch)] = (CLEAN, "")
    return [(patch_label(p), *rows[patch_label(p)]) for p in relevant]


def drift(versions=None):
    """{version: (wheel sha256, rows)} for each release tried."""
    pin = load_pin()
    versions = versions or default_versions()
    report = {}
    for version in versions:
        wheel = download_wheel(pin["package"], version, cache_dir() / "wheels")
        with tempfile.TemporaryDirectory() as tmp:
            unpack_subtree(wheel, pin["subtree"], Path(tmp))
            report[version] = (sha256_of(wheel), check_tree(tmp))
    return report
