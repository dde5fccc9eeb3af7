"""The upstream main commit that the pull request is made against: its files, and the series on it.

The patches that change existing upstream files outside the release's package (TE's own tests,
qa/ scripts and docs, which the wheel does not carry) are made against this commit. Its tree is
exported once into the cache, from a TE git repository (a clone or a mirror, given as SOURCE or
$TE_SOURCE) or, without one, from the archive of that tree pinned in upstream.json
($TE_MAIN_ARCHIVE, by default ../shared/upstream/ beside the checkout, as CI has it); nothing of
it is committed.
"""

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from ..errors import ToolError
from ..patching import git, git_am
from ..paths import repo_root
from ..series import identity_env, load_series, patch_files, pr_patch_files
from ..upstream import cache_dir, load_pin, sha256_of

# In a checkout of this repository: the pinned main tree with the series applied (git-ignored),
# where the series' changes to upstream main files are edited.
MAIN_DIR = "te-main"
ARCHIVE_ENV = "TE_MAIN_ARCHIVE"
# Why there is no main tree, and what to do, for the commands that need it.
NO_MAIN_TREE = (
    "no TE source given and no archive of the pinned main tree: pass --source or set "
    "TE_SOURCE to a TransformerEngine git clone holding the pinned main commit, or set "
    f"{ARCHIVE_ENV} to the archive that upstream.json pins (main.archive)"
)


def load_main_pin():
    """The pinned main commit: repository, branch, commit, date, version (and its archive)."""
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


def main_archive():
    """The archive of the pinned main tree ($TE_MAIN_ARCHIVE, else upstream.json's `archive`
    under ../shared/upstream/ beside the repository checkout), or None where there is none
    (or upstream.json pins none)."""
    archive = load_main_pin().get("archive")
    if archive is None:
        return None
    given = os.environ.get(ARCHIVE_ENV)
    if given:
        if not Path(given).is_file():
            raise ToolError(f"{ARCHIVE_ENV}={given}: no such file")
        return Path(given)
    root = repo_root()
    path = root.parent / "shared" / "upstream" / archive["name"] if root is not None else None
    return path if path is not None and path.is_file() else None


def _export(source, main):
    """The pinned main tree as a tar archive (opened), from the git repository `source` or
    from the pinned archive, checked by its sha256; and the prefix of its members."""
    if source is not None:
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
        return tarfile.open(fileobj=io.BytesIO(archive)), ""
    pinned, path = main["archive"], main_archive()
    actual = sha256_of(path)
    if actual != pinned["sha256"]:
        raise ToolError(
            f"{path}: sha256 {actual} does not match the pinned {pinned['sha256']} of the "
            f"archive of {main['commit'][:12]}; refusing to use it"
        )
    return tarfile.open(path), pinned["prefix"]


def main_tree(source=None):
    """The pristine tree of the pinned main commit (cached, read only by convention), exported
    the first time from `source` or $TE_SOURCE, else from the pinned archive; None if it is
    not cached and neither is at hand."""
    main = load_main_pin()
    root = cache_dir() / f"main-{main['commit'][:12]}"
    if (root / "tree" / ".commit").is_file():
        return root / "tree"
    source = main_source(source)
    if source is None and main_archive() is None:
        return None
    tar, prefix = _export(source, main)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
    with tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.name != prefix]
        for member in members:
            member.name = member.name[len(prefix) :]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp / "tree", members=members, filter="data")
        else:  # Python < 3.10.12: no filters; the archive is git's own output
            tar.extractall(tmp / "tree", members=members)
    (tmp / "tree" / ".commit").write_text(main["commit"] + "\n", encoding="utf-8")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root / "tree"


def check_main(source=None):
    """`git am` each pull request of the stack in turn onto the pinned main tree (from
    `source`, a TE git repository that is not changed, or as main_tree finds it), committed in
    a scratch repository. Returns a report; raises ToolError if there is no main tree or a
    patch does not apply."""
    main = load_main_pin()
    commit = main["commit"]
    if main_source(source) is not None:
        _check_source(main_source(source), main)
    tree = main_tree(source)
    if tree is None:
        raise ToolError(NO_MAIN_TREE)
    env = identity_env(load_series()["author"])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "te"
        shutil.copytree(tree, work, symlinks=True, ignore=shutil.ignore_patterns(".commit"))
        git(["init", "-q", "-b", "main"], work, env)
        git(["add", "-A", "-f"], work, env)
        git(["commit", "-q", "-m", f"upstream main {commit[:12]}"], work, env)
        base = git(["rev-parse", "HEAD"], work, env).stdout.strip()
        for pr_dir, patches in pr_patch_files():
            git_am(work, patches, env, what=f"git am of {pr_dir.name} onto main {commit[:12]}")
        subjects = git(["log", "--format=%s", f"{base}..HEAD"], work, env).stdout
    lines = [
        (
            f"git am of {len(patch_files())} patches onto {main['repository']} {main['branch']} "
            f"{commit[:12]} ({main['date']}, {main['version']}): applied"
        ),
    ]
    lines += [f"  {s}" for s in reversed(subjects.splitlines())]
    return "\n".join(lines)
