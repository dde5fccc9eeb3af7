"""git, and the ways the tool puts patches into a tree: `git apply` of patches in turn
(apply_in_order, for every tree the tool patches or reads), or of all of them in one git
process (apply_at_once, which simulate tries first on a scratch copy of a target's files), and
`git am` (git_am, for a git repository that gets the series as commits). Nothing else runs
them."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from .errors import NeedsError, ToolError, fault
from .series import hunk_headers, patch_label


def git(args, cwd, env=None, check=True, input_text=None, shielded=False):
    """Run git; raise ToolError with its output if it fails and `check`. A Ctrl-C that stops
    the tool meanwhile is passed on to git (where it did not get it from the terminal) and
    raised once git has exited: git cleans up after a Ctrl-C (its lock files), not after the
    SIGKILL that subprocess.run sends an interrupted child. `shielded` runs git in a session
    of its own, out of reach of a Ctrl-C at the terminal, for a short change that must not
    stop halfway (git reset leaves the files half reset and HEAD where it was)."""
    full_env = dict(os.environ)
    for key in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        full_env.pop(key, None)
    full_env.update(env or {})
    try:  # the process is waited for in the `with` below
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            ["git", *args],
            cwd=cwd,
            env=full_env,
            stdin=subprocess.DEVNULL if input_text is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=shielded,
        )
    except FileNotFoundError as exc:
        if not shutil.which("git"):
            raise NeedsError("git is needed but was not found on PATH; install git") from exc
        raise
    with proc:
        try:
            fault("git")
            stdout, stderr = proc.communicate(input_text)
        except KeyboardInterrupt:
            if proc.stdin:  # the rest of the input is not written: end it
                proc.stdin.close()
            if not shielded and proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # where git did not get the Ctrl-C itself
            proc.communicate()  # until git exits (the tool ignores further Ctrl-Cs)
            raise
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise ToolError(f"git {' '.join(args)} failed:\n{result.stderr.strip()}")
    return result


def touched(patch):
    """The files a patch changes (its `+++ b/` paths), in its order."""
    prefix = "+++ b/"
    lines = Path(patch).read_text(encoding="utf-8").splitlines()
    return [line[len(prefix) :] for line in lines if line.startswith(prefix)]


def _apply_args(root, include, reverse):
    """The environment and arguments of git apply (-v) on the files under `root`."""
    env = {"GIT_CEILING_DIRECTORIES": str(Path(root).resolve().parent)}
    args = ["apply", "-v", *(f"--include={pattern}" for pattern in include)]
    return env, args + (["-R"] if reverse else [])


def apply_in_order(root, patches, include=(), reverse=False, check=False):
    """git apply (or, with `reverse`, git apply -R) each of `patches` in turn to the files under
    `root`, never to a repository around it; `include` restricts them to those paths (git
    apply --include patterns). Yields (patch, git apply -v's result) after each, so that the
    caller can read the tree in between, and stops at the first that does not apply; with
    `check`, that one raises ToolError (where it stops, and why) instead."""
    env, args = _apply_args(root, include, reverse)
    for patch in patches:
        result = git([*args, str(patch)], root, env, check=False)
        if result.returncode != 0 and check:
            raise ToolError(f"{patch_label(patch)}: {failure(result, patch)}")
        yield patch, result
        if result.returncode != 0:
            return


def apply_at_once(root, patches, include=(), reverse=False):
    """One git apply (or git apply -R) of all of `patches`, in order, to the files under
    `root`: the list of what apply_in_order yields, where this one run tells it: for one
    patch, its result; for several, if every patch applies and no hunk at an offset (each
    patch's result then has no output of its own). Else None, and the files under `root` are
    as git left them: git applies each patch file before it reads the next, so those before
    the one that does not apply are applied. A caller that needs to know which patch does
    not apply, or where the offsets are, applies them in turn to a fresh copy."""
    if not patches:
        return []
    env, args = _apply_args(root, include, reverse)
    result = git([*args, *map(str, patches)], root, env, check=False)
    if len(patches) == 1:  # the very git apply that apply_in_order runs
        return [(patches[0], result)]
    if result.returncode != 0 or offsets(result):
        return None
    return [(patch, subprocess.CompletedProcess(result.args, 0, "", "")) for patch in patches]


def apply_all(root, patches, include=()):
    """apply_in_order(..., check=True) to the end: the number of patches applied."""
    return sum(1 for _ in apply_in_order(root, patches, include, check=True))


def all_apply(results):
    """Whether every (patch, result) of apply_in_order applied."""
    return all(result.returncode == 0 for _, result in results)


def failure(result, patch):
    """Where a patch stopped applying: file, line and hunk."""
    headers = hunk_headers(patch)
    for line in result.stderr.splitlines():
        m = re.match(r"error: patch failed: (.+):(\d+)$", line)
        if m:
            path, start = m.group(1), int(m.group(2))
            return f"{path}: hunk {headers.get((path, start), f'at line {start}')} does not apply"
        m = re.match(r"error: (.+): No such file or directory$", line)
        if m:
            return f"{m.group(1)}: missing"
    return result.stderr.strip() or "does not apply"


def offsets(result):
    """The hunks that git apply -v applied at another line than the patch says."""
    return re.findall(r"Hunk #\d+ succeeded at \d+ \(offset -?\d+ lines?\)", result.stderr)


def simulate(files, patches, include=(), reverse=False):
    """git apply (or, with `reverse`, git apply -R) `patches` in turn to a scratch copy of
    `files` ({path: bytes, or None for a file that is not there}), stopping at the first that
    fails: ([(patch, git apply's result)], {path: bytes} of the files after them, those that
    are there, if all apply, else None). Later patches of the series may change what earlier
    ones changed, so only this order tells whether each applies. They are tried in one git
    process first (apply_at_once); where that does not tell each patch's result (one of several
    does not apply, or a hunk applies at an offset), they are applied one by one to a fresh
    copy. `include`: as for apply_in_order."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = _scratch_copy(files, Path(tmp) / "at-once")
        fault("scratch")
        results = apply_at_once(copy, patches, include, reverse)
        if results is None:  # the copy holds what git left of it: start again from the files
            copy = _scratch_copy(files, Path(tmp) / "in-turn")
            results = list(apply_in_order(copy, patches, include, reverse))
        if not all_apply(results):
            return results, None
        return results, {rel: (copy / rel).read_bytes() for rel in files if (copy / rel).is_file()}


def _scratch_copy(files, scratch):
    """A directory at `scratch` holding `files` ({path: bytes or None})."""
    scratch.mkdir(parents=True)
    for rel, data in files.items():
        if data is not None:
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            (scratch / rel).write_bytes(data)
    return scratch


def git_am(repo, patches, env=None, what="git am", include=()):
    """`git am --keep-non-patch` of `patches` in the git repository `repo` (the option keeps
    the `[PyTorch]` title prefixes), restricted to the paths of `include` (git apply --include
    patterns) if any; if one does not apply, the am is aborted and ToolError says `what`
    failed, with git's output; interrupted, it is aborted too."""
    head = git(["rev-parse", "HEAD"], repo, env).stdout.strip()
    args = ["am", "--keep-non-patch", *(f"--include={pattern}" for pattern in include)]
    try:
        result = git([*args, *map(str, patches)], repo, env, check=False)
    except KeyboardInterrupt:  # git am stopped too (or ended): take back the commits it made
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        git(["am", "--abort"], repo, env, check=False)  # which keeps them when interrupted
        git(["reset", "-q", "--keep", head], repo, env, check=False, shielded=True)
        raise
    if result.returncode != 0:
        git(["am", "--abort"], repo, env, check=False)
        output = (result.stdout + result.stderr).strip()
        raise ToolError(f"{what} failed and was aborted:\n{output}")
