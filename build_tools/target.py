"""Apply, check, revert and report the series on a TE tree: installed, a checkout, a directory."""

import importlib.util
import re
import shutil
import tempfile
from pathlib import Path

from .errors import ToolError
from .series import git, hunk_headers, load_checksums, patch_files
from .upstream import load_pin, sha256_of

APPLIED, NOT_APPLIED, DRIFTED = "applied", "not applied", "drifted"
NOT_FOR_TARGET = "not for this target"
NOT_CHECKED = "not checked"


class Target:
    """A directory holding `transformer_engine/` and how to patch it.

    kind "installed" or "tree": the upstream files of the series are patched in place with
    `git apply` (tests and docs are not part of an installed package). kind "checkout": a
    git checkout of TE, which gets the whole series as commits with `git am`.
    """

    def __init__(self, root, kind):
        self.root = Path(root).resolve()
        self.kind = kind
        self.subtree = load_pin()["subtree"]
        if not (self.root / self.subtree).is_dir():
            raise ToolError(f"{self.root} holds no {self.subtree}/ directory")

    def __str__(self):
        return f"{self.kind} TE at {self.root}"

    @property
    def include(self):
        """git apply arguments that restrict a patch to what this target holds."""
        return [] if self.kind == "checkout" else [f"--include={self.subtree}/*"]

    def git_apply(self, patch, *args):
        """Run git apply against this target's files only (never a repository around it)."""
        env = {"GIT_CEILING_DIRECTORIES": str(self.root.parent)}
        return git(["apply", *self.include, *args, str(patch)], self.root, env, check=False)


def find_target(path=None, installed=False):
    """The target named by a path, or the TE that this Python imports."""
    if installed or path is None:
        spec = importlib.util.find_spec("transformer_engine")
        if spec is None or not spec.submodule_search_locations:
            raise ToolError(
                "transformer_engine is not installed in this Python environment "
                "(pass the path of a TE tree instead)"
            )
        return Target(Path(list(spec.submodule_search_locations)[0]).parent, "installed")
    root = Path(path)
    if not root.is_dir():
        raise ToolError(f"{root} is not a directory")
    kind = "checkout" if (root / ".git").exists() else "tree"
    return Target(root, kind)


def _touched(patch, target):
    """Upstream files a patch changes that this target holds."""
    files = []
    for line in Path(patch).read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ b/"):
            rel = line[len("+++ b/") :]
            if target.kind == "checkout" or rel.startswith(target.subtree + "/"):
                files.append(rel)
    return files


def _failure(result, patch):
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


def has_offset(result):
    """Whether git apply -v applied some hunk at another line than the patch says."""
    return re.search(r"offset -?\d+ lines?", result.stderr + result.stdout) is not None


def simulate(target, patches, *reverse):
    """git apply (or, with "-R", reverse) `patches` in turn to a scratch copy of the files they
    change, stopping at the first that fails; [(patch, git apply's result)]. Later patches of
    the series may change what earlier ones changed, so only this order tells whether each
    applies. The target is not touched."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "target"
        (scratch / target.subtree).mkdir(parents=True)
        for patch in patches:
            for rel in _touched(patch, target):
                src, dst = target.root / rel, scratch / rel
                if src.is_file() and not dst.exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dst)
        copy = Target(scratch, target.kind)
        for patch in patches:
            result = copy.git_apply(patch, "-v", *reverse)
            results.append((patch, result))
            if result.returncode != 0:
                break
    return results


def status(target):
    """[(patch name, state, detail)] and the overall state."""
    patches = patch_files()
    relevant = [p for p in patches if _touched(p, target)]
    if not relevant:
        raise ToolError(f"no patch of the series changes anything in {target}")
    rows = {p.name: (NOT_FOR_TARGET, "tests and docs go to source checkouts only") for p in patches}
    forward = simulate(target, relevant)
    if _all_apply(forward):
        overall = NOT_APPLIED
        for patch, result in forward:
            rows[patch.name] = (NOT_APPLIED, "with offset" if has_offset(result) else "")
    elif _all_apply(simulate(target, relevant[::-1], "-R")):
        overall = APPLIED
        for patch in relevant:
            rows[patch.name] = (APPLIED, "")
    else:
        overall = DRIFTED
        applied = _applied_prefix(target, relevant)
        if applied:  # the series is in part: say which patches
            for i, patch in enumerate(relevant):
                rows[patch.name] = (APPLIED, "") if i < applied else (NOT_APPLIED, "")
        else:  # where applying it stops, and why
            for patch in relevant:
                rows[patch.name] = (NOT_CHECKED, "an earlier patch does not apply")
            for patch, result in forward:
                rows[patch.name] = (
                    (NOT_APPLIED, "")
                    if result.returncode == 0
                    else (DRIFTED, _failure(result, patch))
                )
    return [(p.name, *rows[p.name]) for p in patches], overall


def _applied_prefix(target, patches):
    """k if exactly the first k (0 < k < all) of `patches` are applied to the target, else 0."""
    for k in range(len(patches) - 1, 0, -1):
        if _all_apply(simulate(target, patches[:k][::-1], "-R")) and _all_apply(
            simulate(target, patches[k:])
        ):
            return k
    return 0


def _all_apply(results):
    return all(result.returncode == 0 for _, result in results)


def file_report(target):
    """[(path, pristine|patched|other)] for the upstream files the series changes."""
    report = []
    for rel, (before, after) in sorted(load_checksums().items()):
        path = target.root / rel
        if not path.is_file():
            report.append((rel, "missing"))
            continue
        digest = sha256_of(path)
        if digest == before:
            report.append((rel, f"pristine {load_pin()['version']}"))
        elif digest == after:
            report.append((rel, "patched by this series"))
        else:
            report.append((rel, "differs from both"))
    return report


def apply(target):
    """Apply the series; a no-op if applied; changes nothing if any patch does not apply."""
    rows, overall = status(target)
    if overall == APPLIED:
        return "already applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "apply"))
    patches = patch_files()
    if target.kind == "checkout":
        if git(["status", "--porcelain", "--untracked-files=no"], target.root).stdout.strip():
            raise ToolError(f"{target.root} has uncommitted changes; commit or stash them first")
        result = git(["am", "--keep-non-patch", *map(str, patches)], target.root, check=False)
        if result.returncode != 0:
            git(["am", "--abort"], target.root, check=False)
            raise ToolError(f"git am failed; the checkout is unchanged:\n{result.stderr.strip()}")
        return f"applied {len(patches)} patches as commits with git am"
    done = apply_all(target, patches)
    return f"applied {done} patch(es) to {target.subtree}/"


def apply_all(target, patches, *reverse):
    """git apply (or, with "-R", reverse) each patch in turn; undo them all if one fails."""
    done = []
    for patch in patches:
        if not _touched(patch, target):
            continue
        result = target.git_apply(patch, *reverse)
        if result.returncode != 0:
            undo = () if reverse else ("-R",)
            for applied in reversed(done):
                target.git_apply(applied, *undo)
            raise ToolError(f"{patch.name}: {_failure(result, patch)}; nothing was changed")
        done.append(patch)
    return len(done)


def revert(target):
    """Take the series out again; a no-op if it is not applied."""
    rows, overall = status(target)
    if overall == NOT_APPLIED:
        return "not applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "revert"))
    patches = patch_files()
    if target.kind == "checkout":
        subjects = [_subject(p) for p in patches]
        log = git(["log", "--format=%s", f"-{len(patches)}"], target.root).stdout.splitlines()
        if list(reversed(log)) != subjects:
            raise ToolError(
                "the series' commits are not the newest commits of the checkout; "
                "revert them with git revert"
            )
        git(["reset", "-q", "--keep", f"HEAD~{len(patches)}"], target.root)
        return f"removed the {len(patches)} commits of the series"
    undone = apply_all(target, list(reversed(patches)), "-R")
    return f"reverted {undone} patch(es)"


def _subject(patch):
    """The commit title that `git am --keep-non-patch` makes of a patch."""
    lines = Path(patch).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Subject: "):
            subject = line[len("Subject: ") :]
            for more in lines[i + 1 :]:  # folded header lines
                if not more.startswith((" ", "\t")):
                    break
                subject += more
            return re.sub(r"^\[PATCH[^\]]*\] ", "", subject)
    return ""


def _drift_message(target, rows, action):
    lines = [f"cannot {action}: {target} has drifted from what the series expects"]
    lines += [f"  {name}: {state} {detail}".rstrip() for name, state, detail in rows]
    return "\n".join(lines)
