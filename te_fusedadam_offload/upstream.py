"""The pinned upstream release: fetch it from the package index, verify it, unpack it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import NeedsError, ToolError
from .paths import data_file


def load_pin():
    """The pin: package, version, artifact file name, sha256, subtree."""
    with open(data_file("upstream.json"), encoding="utf-8") as f:
        pin = json.load(f)
    for key in ("package", "version", "artifact", "sha256", "subtree"):
        if key not in pin:
            raise ToolError(f"upstream.json has no '{key}'")
    return pin


def cache_dir():
    """Where downloaded releases and unpacked trees are kept."""
    root = os.environ.get("TE_FUSEDADAM_OFFLOAD_CACHE")
    if not root:
        root = os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
            "te-fusedadam-offload",
        )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path):
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(package, version, dest):
    """Download the pure-Python wheel of `package==version` into `dest`; return its path."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for found in dest.glob(f"{package}-{version}-py3-none-any.whl"):
        return found
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--platform",
        "any",
        "--implementation",
        "py",
        "--dest",
        str(dest),
        f"{package}=={version}",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = list(dest.glob(f"{package}-{version}-py3-none-any.whl"))
    if result.returncode != 0 or not found:
        lines = (result.stderr or result.stdout).strip().splitlines()
        tail = "\n".join([line for line in lines if line.startswith("ERROR:")] or lines[-5:])
        raise NeedsError(
            f"could not download {package}=={version} (a py3-none-any wheel) from the package "
            f"index; is the network reachable? pip said:\n{tail}"
        )
    return found[0]


def fetch_pinned(wheel=None):
    """The pinned wheel, downloaded (or the given file) and verified by its sha256."""
    pin = load_pin()
    if wheel is None:
        wheel = download_wheel(pin["package"], pin["version"], cache_dir() / "wheels")
    wheel = Path(wheel)
    if not wheel.is_file():
        raise ToolError(f"{wheel} does not exist (expected {pin['artifact']})")
    actual = sha256_of(wheel)
    if actual != pin["sha256"]:
        raise ToolError(
            f"{wheel.name}: sha256 {actual} does not match the pinned {pin['sha256']} "
            f"of {pin['artifact']}; refusing to use it"
        )
    return wheel


def unpack_subtree(wheel, subtree, dest):
    """Unpack `subtree/` of a wheel into `dest/subtree` (created; must not exist)."""
    dest = Path(dest)
    if (dest / subtree).exists():
        raise ToolError(f"{dest / subtree} already exists")
    prefix = subtree.rstrip("/") + "/"
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(prefix) and not m.endswith("/")]
        if not members:
            raise ToolError(f"{wheel} holds no {prefix}")
        for member in members:
            target = dest / member
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    return dest / subtree


def pristine_tree(wheel=None):
    """A cached, read-only-by-convention copy of the pinned subtree; returns its root dir."""
    pin = load_pin()
    root = cache_dir() / f"pristine-{pin['package']}-{pin['version']}-{pin['sha256'][:12]}"
    if not (root / pin["subtree"]).is_dir():
        wheel = fetch_pinned(wheel)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
        unpack_subtree(wheel, pin["subtree"], tmp)
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
    return root
