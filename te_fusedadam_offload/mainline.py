"""The upstream main commit that the pull request is made against: its files, and the series on it.

The patches that change existing upstream files outside the release's package (TE's own tests,
qa/ scripts and docs, which the wheel does not carry) are made against this commit. Its tree is
exported once from a TE git repository (a clone or a mirror, given as SOURCE or $TE_SOURCE) into
the cache; nothing of it is committed.
"""

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from .errors import ToolError
from .patching import git, git_am
from .series import identity_env, load_series, patch_files
from .upstream import cache_dir, load_pin

# In a checkout of this repository: the pinned main tree with the series applied (git-ignored),
# where the series' changes to upstream main files are edited.
MAIN_DIR = "te-main"


def load_main_pin():
    """The pinned main commit: repository, branch, commit, date, version."""
    main = load_pin().get("main")
    if not main or "commit" not in main:
        raise ToolError("upstream.json pins no main commit ('main': {'commit': ...})")
    return main


def _check_source(source, main):
    source = Path(source).resolve()
    if git(["rev-parse", "--git-dir"], source, check=False).returncode != 0:
        raise ToolError(f"{source} is not a git repository (expected a TransformerEngine clone)")
    if git(["cat-file", "-e", f"{main['commit']}^{{commit}}"], source, check=False).returncode:
        raise ToolError(
            f"{source} does not hold the pinned main commit {main['commit']} ({main['date']}); "
            f"fetch {main['branch']} from {main['repository']} first"
        )
    return source


def main_source(source=None):
    """The TE git repository given (argument, else $TE_SOURCE), or None."""
    return source or os.environ.get("TE_SOURCE") or None


def main_tree(source=None):
    """The pristine tree of the pinned main commit (cached, read only by convention), exported
    from `source` or $TE_SOURCE the first time; None if it is not cached and no source is given."""
    main = load_main_pin()
    root = cache_dir() / f"main-{main['commit'][:12]}"
    if (root / "tree" / ".commit").is_file():
        return root / "tree"
    source = main_source(source)
    if source is None:
        return None
    source = _check_source(source, main)
    try:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", main["commit"]],
            cwd=source,
            capture_output=True,
            check=True,
        ).stdout
    except subprocess.CalledProcessError as exc:
        raise ToolError(
            f"git archive {main['commit']} failed: {exc.stderr.decode().strip()}"
        ) from exc
    tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp / "tree", filter="data")
        else:  # Python < 3.10.12: no filters; the archive is git's own output
            tar.extractall(tmp / "tree")
    (tmp / "tree" / ".commit").write_text(main["commit"] + "\n", encoding="utf-8")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root / "tree"


def check_main(source):
    """`git am` the whole series onto the pinned main commit, in a scratch clone of the TE git
    repository `source` (a checkout or a bare mirror; it is not changed). Returns a report;
    raises ToolError if the commit is missing or a patch does not apply."""
    main = load_main_pin()
    source, commit = _check_source(source, main), main["commit"]
    patches = patch_files()
    env = identity_env(load_series()["author"])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "te"
        git(["clone", "--quiet", "--shared", "--no-checkout", str(source), str(work)], tmp, env)
        git(["checkout", "--quiet", "--detach", commit], work, env)
        git_am(work, patches, env, what=f"git am onto main {commit[:12]}")
        subjects = git(["log", "--format=%s", f"{commit}..HEAD"], work, env).stdout
    lines = [
        (
            f"git am of {len(patches)} patches onto {main['repository']} {main['branch']} "
            f"{commit[:12]} ({main['date']}, {main['version']}): applied"
        ),
    ]
    lines += [f"  {s}" for s in reversed(subjects.splitlines())]
    return "\n".join(lines)
