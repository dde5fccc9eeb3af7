"""The upstream main commit that the pull request is made against: check the series on it."""

import tempfile
from pathlib import Path

from .errors import ToolError
from .series import identity_env, git, load_series, patch_files
from .upstream import load_pin


def load_main_pin():
    """The pinned main commit: repository, branch, commit, date, version."""
    main = load_pin().get("main")
    if not main or "commit" not in main:
        raise ToolError("upstream.json pins no main commit ('main': {'commit': ...})")
    return main


def check_main(source):
    """`git am` the whole series onto the pinned main commit, in a scratch clone of the TE git
    repository `source` (a checkout or a bare mirror; it is not changed). Returns a report;
    raises ToolError if the commit is missing or a patch does not apply."""
    main = load_main_pin()
    source, commit = Path(source).resolve(), main["commit"]
    if git(["rev-parse", "--git-dir"], source, check=False).returncode != 0:
        raise ToolError(f"{source} is not a git repository (expected a TransformerEngine clone)")
    if git(["cat-file", "-e", f"{commit}^{{commit}}"], source, check=False).returncode != 0:
        raise ToolError(
            f"{source} does not hold the pinned main commit {commit} ({main['date']}); "
            f"fetch {main['branch']} from {main['repository']} first"
        )
    patches = patch_files()
    env = identity_env(load_series()["author"])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "te"
        git(["clone", "--quiet", "--shared", "--no-checkout", str(source), str(work)], tmp, env)
        git(["checkout", "--quiet", "--detach", commit], work, env)
        result = git(["am", "--keep-non-patch", *map(str, patches)], work, env, check=False)
        if result.returncode != 0:
            raise ToolError(
                f"git am onto main {commit[:12]} failed:\n{(result.stdout + result.stderr).strip()}"
            )
        subjects = git(["log", "--format=%s", f"{commit}..HEAD"], work, env).stdout
    lines = [
        (
            f"git am of {len(patches)} patches onto {main['repository']} {main['branch']} "
            f"{commit[:12]} ({main['date']}, {main['version']}): applied"
        ),
    ]
    lines += [f"  {s}" for s in reversed(subjects.splitlines())]
    return "\n".join(lines)
