"""A TE that another user patched: site-packages this user cannot write, or a group-writable
one (umask 002) where it can. The tool runs as uid 65534 (nobody), which needs root here; the
tests are skipped where they cannot drop to it."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import REPO, listing, run_tool, same_tree, tool_env

BACKUP = "transformer_engine/.te_fusedadam_offload"
NOBODY = 65534


def _as_nobody():
    """The command prefix that runs a program as uid/gid 65534, or None."""
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    return None


def _python_for_nobody(prefix):
    """A Python 3.11+ that uid 65534 can run (this one may live in root's home), or None."""
    for python in (sys.executable, "/usr/bin/python3"):
        check = "import sys, tomllib; sys.exit(sys.version_info < (3, 11))"
        ran = subprocess.run([*prefix, python, "-c", check], capture_output=True, check=False)
        if ran.returncode == 0:
            return python
    return None


@pytest.fixture
def as_other_user(pristine):
    """(root of a TE tree that every user can read, run(args) as uid 65534)."""
    prefix = _as_nobody()
    if prefix is None:
        pytest.skip("needs root and setpriv or runuser to run the tool as another user")
    python = _python_for_nobody(prefix)
    if python is None:
        pytest.skip("no Python 3.11+ that uid 65534 can run")
    home = Path(tempfile.mkdtemp(prefix="te-other-user-"))
    home.chmod(0o755)
    root = home / "site"
    shutil.copytree(pristine / "transformer_engine", root / "transformer_engine")

    def run(args):
        return subprocess.run(
            [*prefix, python, "-m", "te_fusedadam_offload", *args],
            cwd="/",
            env=tool_env(TMPDIR="/tmp"),
            capture_output=True,
            text=True,
            check=False,
        )

    if not os.access(REPO, os.R_OK | os.X_OK) or run(["--version"]).returncode != 0:
        shutil.rmtree(home)
        pytest.skip(f"uid 65534 cannot run the tool from {REPO}")
    yield root, run
    shutil.rmtree(home)


def _applied_by_root(root, tmp_path):
    assert run_tool(["apply", str(root)]).returncode == 0
    snapshot = tmp_path / "snapshot"
    shutil.copytree(root, snapshot)
    return snapshot


def test_another_user_finds_it_applied_and_changes_nothing(as_other_user, tmp_path):
    root, run = as_other_user
    snapshot = _applied_by_root(root, tmp_path)
    saved = root / BACKUP / "original" / "transformer_engine/pytorch/optimizers/fused_adam.py"
    assert saved.stat().st_mode & 0o777 == 0o644  # the mode of the file it saves
    result = run(["apply", str(root)])
    assert (result.returncode, result.stderr) == (0, "")
    assert "already applied; nothing to do" in result.stdout
    result = run(["apply", "--dry-run", str(root)])
    assert (result.returncode, result.stderr) == (0, "")
    assert "apply would say: already applied" in result.stdout
    result = run(["revert", str(root)])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "Permission denied" in result.stderr and "nothing was changed" in result.stderr
    assert same_tree(root, snapshot) and listing(root) == listing(snapshot)


def test_what_another_user_cannot_read_is_never_removed(as_other_user, tmp_path):
    """A group-writable TE where what apply saved is not readable by this user (an earlier
    version of the tool wrote it 0600): apply finds the series applied and keeps it; revert
    and the commands that need it refuse and change nothing."""
    root, run = as_other_user
    _applied_by_root(root, tmp_path)
    for path in [root / BACKUP, *(root / BACKUP).rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o600)
    (root / "transformer_engine").chmod(0o777)
    snapshot = tmp_path / "snapshot-0600"
    shutil.copytree(root, snapshot)
    result = run(["apply", str(root)])
    assert (result.returncode, result.stderr) == (0, "")
    assert "already applied; nothing to do" in result.stdout
    assert same_tree(root, snapshot) and listing(root) == listing(snapshot)
    result = run(["apply", "--dry-run", str(root)])
    assert (result.returncode, result.stderr) == (0, "")
    for args in (["revert"], ["revert", "--discard-edits"]):
        result = run([*args, str(root)])
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
        assert "cannot read" in result.stderr and "nothing was changed" in result.stderr
        assert same_tree(root, snapshot) and listing(root) == listing(snapshot)
    (root / BACKUP / "state.json").chmod(0o600)  # not even the state file
    result = run(["apply", str(root)])
    assert result.returncode == 0 and "already applied" in result.stdout, result.stderr
    assert same_tree(root, snapshot) and listing(root) == listing(snapshot)
