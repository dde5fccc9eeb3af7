"""Apply, check, revert and report the series on a TE tree: installed, a checkout, a directory.

An installed TE or a directory is changed file by file, each atomically: the new content is
written to a temporary file beside the old one, synced, given the old file's mode and renamed
over it. Before the first file is replaced, the original bytes and modes are saved in
<subtree>/.te_fusedadam_offload/ (committed by writing its state.json last), and kept until a
revert. So a run that is killed or fails at any point leaves every file either as it was or as
the series makes it, the next apply completes an interrupted apply, and revert restores the
exact original bytes and modes.
"""

import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

from .errors import ToolError
from .series import git, hunk_headers, load_checksums, patch_files, patch_label
from .upstream import load_pin, sha256_of

APPLIED, NOT_APPLIED, DRIFTED = "applied", "not applied", "drifted"
INTERRUPTED = "interrupted"
NOT_FOR_TARGET = "not for this target"
NOT_CHECKED = "not checked"

BACKUP_DIR = ".te_fusedadam_offload"  # in <root>/<subtree>/: the saved originals
STATE_FILE = "state.json"  # {"files": {path: {"mode", "original", "patched"}}}, written last
TMP_SUFFIX = ".te-fusedadam-offload.tmp"
FAULT_ENV = "TE_FUSEDADAM_OFFLOAD_FAULT"
_fault_counts = {}


def _fault(point):
    """Test hook. With TE_FUSEDADAM_OFFLOAD_FAULT=POINT[#N]:ACTION the N-th time (default: the
    first) that the tool reaches POINT it kills itself (ACTION "kill", SIGKILL) or fails as a
    full or broken disk would ("enospc", "eio"). Points: "write" (half of a new file written),
    "replace" (a new file written and synced, before it replaces the old one), "unlink" (before
    the saved originals are removed)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    where, _, action = spec.partition(":")
    name, _, nth = where.partition("#")
    if name != point:
        return
    _fault_counts[point] = _fault_counts.get(point, 0) + 1
    if _fault_counts[point] != int(nth or 1):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    code = {"enospc": errno.ENOSPC, "eio": errno.EIO}[action]
    raise OSError(code, os.strerror(code))


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path, data, mode):
    """Replace (or create) `path` with `data` and `mode`, atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            _fault("write")
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        _fault("replace")
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _sync_dir(path.parent)


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _file_digest(path):
    """sha256 of a file, or None if there is none."""
    return sha256_of(path) if path.is_file() else None


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
            hint = ""
            if self.root.name == self.subtree:
                hint = f"; pass the directory that holds it, {self.root.parent}"
            raise ToolError(f"{self.root} holds no {self.subtree}/ directory{hint}")

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


def te_version(target):
    """The TE version of a target, or None if it does not say: the package metadata beside an
    installed TE, or build_tools/VERSION.txt of a source checkout."""
    for meta in sorted(target.root.glob(f"{target.subtree}-*.dist-info/METADATA")):
        found = re.search(r"^Version: *(\S+)", meta.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found.group(1)
    version_file = target.root / "build_tools" / "VERSION.txt"
    if version_file.is_file():
        return version_file.read_text(encoding="utf-8").strip()
    return None


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


def relevant_patches(target, patches=None):
    """The patches of the series (or of `patches`) that change files this target holds."""
    return [p for p in (patch_files() if patches is None else patches) if _touched(p, target)]


def simulate(target, patches, *reverse, originals=None, contents=None):
    """git apply (or, with "-R", reverse) `patches` in turn to a scratch copy of the files they
    change, stopping at the first that fails; [(patch, git apply's result)]. Later patches of
    the series may change what earlier ones changed, so only this order tells whether each
    applies. The target is not touched. `originals` ({path: bytes}) stand in for the target's
    files; if all patches apply, `contents` (a dict) gets {path: bytes} of the files after
    them."""
    results = []
    touched = list(dict.fromkeys(rel for patch in patches for rel in _touched(patch, target)))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "target"
        (scratch / target.subtree).mkdir(parents=True)
        for rel in touched:
            src, dst = target.root / rel, scratch / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if originals is not None and rel in originals:
                dst.write_bytes(originals[rel])
            elif src.is_file():
                shutil.copyfile(src, dst)
        copy = Target(scratch, target.kind)
        for patch in patches:
            result = copy.git_apply(patch, "-v", *reverse)
            results.append((patch, result))
            if result.returncode != 0:
                break
        if contents is not None and _all_apply(results):
            contents.update({rel: (scratch / rel).read_bytes() for rel in touched})
    return results


def status(target):
    """[(patch name, state, detail)] and the overall state."""
    patches = patch_files()
    relevant = relevant_patches(target, patches)
    if not relevant:
        raise ToolError(f"no patch of the series changes anything in {target}")
    rows = {
        patch_label(p): (NOT_FOR_TARGET, "tests and docs go to source checkouts only")
        for p in patches
    }
    saved = _Backup(target).states()
    if saved and set(saved.values()) == {"original", "patched"}:
        for patch in relevant:
            rows[patch_label(patch)] = (
                INTERRUPTED,
                "an apply or revert was interrupted: run apply to complete the series, or revert",
            )
        return [(patch_label(p), *rows[patch_label(p)]) for p in patches], INTERRUPTED
    forward = simulate(target, relevant)
    if _all_apply(forward):
        overall = NOT_APPLIED
        for patch, result in forward:
            rows[patch_label(patch)] = (NOT_APPLIED, "with offset" if has_offset(result) else "")
    elif _all_apply(simulate(target, relevant[::-1], "-R")):
        overall = APPLIED
        for patch in relevant:
            rows[patch_label(patch)] = (APPLIED, "")
    else:
        overall = DRIFTED
        applied = _applied_prefix(target, relevant)
        if applied:  # the series is in part (an earlier version of this tool was interrupted)
            overall = INTERRUPTED
            for i, patch in enumerate(relevant):
                rows[patch_label(patch)] = (APPLIED, "") if i < applied else (NOT_APPLIED, "")
        else:  # where applying it stops, and why
            for patch in relevant:
                rows[patch_label(patch)] = (NOT_CHECKED, "an earlier patch does not apply")
            for patch, result in forward:
                rows[patch_label(patch)] = (
                    (NOT_APPLIED, "")
                    if result.returncode == 0
                    else (DRIFTED, _failure(result, patch))
                )
    return [(patch_label(p), *rows[patch_label(p)]) for p in patches], overall


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
    saved = _Backup(target).states() or {}
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
        elif saved.get(rel) == "patched":
            report.append((rel, "patched by another version of this series; apply replaces it"))
        else:
            report.append((rel, "differs from both"))
    return report


class _Backup:
    """The original bytes and modes of the files that the series changes in a target, saved
    in <root>/<subtree>/.te_fusedadam_offload/ by apply and removed by revert."""

    def __init__(self, target):
        self.target = target
        self.dir = target.root / target.subtree / BACKUP_DIR
        self.state = None
        try:
            state = json.loads((self.dir / STATE_FILE).read_text(encoding="utf-8"))["files"]
            if all(self.original(rel, state) is not None for rel in state):
                self.state = state
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, or not complete: no file was replaced after it

    def original(self, rel, state=None):
        """The saved original bytes of `rel`, or None if they are not (all) there."""
        state = state or self.state
        try:
            data = (self.dir / "original" / rel).read_bytes()
        except OSError:
            return None
        return data if _sha256(data) == state[rel]["original"] else None

    def states(self):
        """{path: "original" | "patched" | "other"} of the saved files, or None if none."""
        if self.state is None:
            return None
        found = {}
        for rel, entry in self.state.items():
            digest = _file_digest(self.target.root / rel)
            found[rel] = {entry["original"]: "original", entry["patched"]: "patched"}.get(
                digest, "other"
            )
        return found

    def save(self, originals, modes, contents):
        """Save the originals; the state file, written last, makes them count."""
        for rel, data in originals.items():
            path = self.dir / "original" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, data, 0o600)
        state = {
            rel: {
                "mode": modes[rel],
                "original": _sha256(originals[rel]),
                "patched": _sha256(contents[rel]),
            }
            for rel in originals
        }
        text = json.dumps({"files": state}, indent=1, sort_keys=True) + "\n"
        write_file(self.dir / STATE_FILE, text.encode("utf-8"), 0o644)
        self.state = state

    def remove(self):
        """Forget the originals: the state file first, then the rest."""
        _fault("unlink")
        (self.dir / STATE_FILE).unlink(missing_ok=True)
        _sync_dir(self.dir)
        shutil.rmtree(self.dir)
        self.state = None


def _remove_stale_files(target):
    """Temporary files that a killed run left, and saved originals that no state file counts."""
    dirs = {(target.root / rel).parent for p in patch_files() for rel in _touched(p, target)}
    backup = _Backup(target)
    dirs.add(backup.dir)
    for directory in dirs:
        for stale in directory.glob(f".*{TMP_SUFFIX}"):
            stale.unlink()
    if backup.state is None and backup.dir.is_dir():
        shutil.rmtree(backup.dir)


def _write_files(target, contents, modes, action):
    """Write `contents` ({path: bytes}) into the target; if that fails, say what it left."""
    before = {rel: _file_digest(target.root / rel) for rel in contents}
    for rel, data in contents.items():
        try:
            write_file(target.root / rel, data, modes[rel])
        except OSError as exc:
            raise ToolError(
                f"{action} stopped: {exc.strerror or exc} while writing {target.root / rel}; "
                + _checked_state(target, before, contents)
            ) from exc


def _checked_state(target, before, contents):
    """What the files are now, read back after a failure: as before, or written."""
    now = {}
    for rel, data in contents.items():
        digest = _file_digest(target.root / rel)
        if digest == before[rel]:
            now[rel] = "as before"
        else:
            now[rel] = "written" if digest == _sha256(data) else "changed otherwise"
    if set(now.values()) == {"as before"}:
        return "nothing was changed (checked)"
    listing = ", ".join(f"{rel}: {state}" for rel, state in sorted(now.items()))
    return f"checked: {listing}; run apply again to complete the series, or revert to undo it"


def _modes(target, paths):
    return {rel: (target.root / rel).stat().st_mode & 0o7777 for rel in paths}


def apply(target):
    """Apply the series; a no-op if applied. Every file is replaced atomically, after the
    originals were saved, so an interrupted apply is completed by the next one."""
    if target.kind == "checkout":
        return _apply_checkout(target)
    _remove_stale_files(target)
    relevant = relevant_patches(target)
    backup = _Backup(target)
    saved = backup.states()
    if saved and "other" not in saved.values():
        results, contents, other = _against_saved(target, relevant, backup, saved)
        if other:
            return _replace_other_version(target, results)
        todo = [rel for rel, state in saved.items() if state == "original"]
        if not todo:
            return "already applied; nothing to do"
        modes = {rel: backup.state[rel]["mode"] for rel in todo}
        _write_files(target, {rel: contents[rel] for rel in todo}, modes, "apply")
        return f"completed an interrupted apply ({len(todo)} file(s) written)"
    rows, overall = status(target)
    if overall == APPLIED:
        return "already applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "apply"))
    # Not applied, or the first patches only: the files before and after the whole series.
    applied = _applied_count(rows, relevant)
    originals, contents = {}, {}
    simulate(target, relevant[:applied][::-1], "-R", contents=originals)
    simulate(target, relevant[applied:], contents=contents)
    current = {rel: (target.root / rel).read_bytes() for rel in {**originals, **contents}}
    contents = {rel: data for rel, data in contents.items() if data != current[rel]}
    originals = {rel: originals.get(rel, current[rel]) for rel in contents}
    modes = _modes(target, contents)
    try:
        backup.save(originals, modes, contents)
    except OSError as exc:
        shutil.rmtree(backup.dir, ignore_errors=True)  # not committed: no file was replaced
        before = {rel: _sha256(data) for rel, data in originals.items()}
        raise ToolError(
            f"apply stopped: {exc.strerror or exc} while saving the originals in {backup.dir}; "
            + _checked_state(target, before, contents)
        ) from exc
    try:
        _write_files(target, contents, modes, "apply")
    except ToolError:
        if set(backup.states().values()) == {"original"}:  # no file replaced: forget them
            try:
                backup.remove()
            except OSError:
                pass
        raise
    done = f"applied {len(relevant) - applied} patch(es) to {target.subtree}/"
    if applied:
        done += f" (the first {applied} were applied already)"
    return done + _version_note(target)


def _against_saved(target, relevant, backup, saved):
    """This version of the series applied to the saved originals: (git apply's results, the
    files after it, whether the target carries another version of the series)."""
    originals = {rel: backup.original(rel) for rel in saved}
    contents = {}
    results = simulate(target, relevant, originals=originals, contents=contents)
    other = set(contents) != set(saved) or any(
        backup.state[rel]["patched"] != _sha256(data) for rel, data in contents.items()
    )
    return results, contents, other


def other_version(target):
    """Whether the target carries another version of the series (with its saved originals)
    that apply would replace with this one."""
    if target.kind == "checkout":
        return False
    backup = _Backup(target)
    saved = backup.states()
    if not saved or "other" in saved.values():
        return False
    relevant = relevant_patches(target)
    results, _, other = _against_saved(target, relevant, backup, saved)
    return other and _all_apply(results)


def _replace_other_version(target, results):
    """The target carries another version of the series (applied by another release of this
    tool, whose saved originals are there): put the originals back and apply this version,
    if it applies to them; else change nothing."""
    if not _all_apply(results):
        patch, result = results[-1]
        raise ToolError(
            f"{target.subtree}/ carries another version of this series, and this version does "
            f"not apply to the original files saved with it ({patch_label(patch)}: "
            f"{_failure(result, patch)}); nothing was changed. 'revert' restores the originals."
        )
    undone = revert(target)
    return f"replaced another version of the series ({undone}): {apply(target)}"


def _applied_count(rows, patches):
    states = {name: state for name, state, _ in rows}
    return sum(1 for patch in patches if states[patch_label(patch)] == APPLIED)


def _apply_checkout(target):
    rows, overall = status(target)
    if overall == APPLIED:
        return "already applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "apply"))
    patches = patch_files()
    if git(["status", "--porcelain", "--untracked-files=no"], target.root).stdout.strip():
        raise ToolError(f"{target.root} has uncommitted changes; commit or stash them first")
    result = git(["am", "--keep-non-patch", *map(str, patches)], target.root, check=False)
    if result.returncode != 0:
        git(["am", "--abort"], target.root, check=False)
        raise ToolError(f"git am failed and was aborted:\n{result.stderr.strip()}")
    return f"applied {len(patches)} patches as commits with git am"


def apply_all(target, patches, *reverse):
    """git apply (or, with "-R", reverse) each patch in turn, in place: for scratch copies that
    the tool makes itself (materialize), not for a user's TE."""
    done = 0
    for patch in patches:
        if not _touched(patch, target):
            continue
        result = target.git_apply(patch, *reverse)
        if result.returncode != 0:
            raise ToolError(f"{patch_label(patch)}: {_failure(result, patch)}")
        done += 1
    return done


def revert(target):
    """Take the series out again; a no-op if it is not applied. The saved originals are
    written back with their modes; without them (a TE patched otherwise), the series is
    reversed."""
    patches = patch_files()
    if target.kind == "checkout":
        return _revert_checkout(target, patches)
    _remove_stale_files(target)
    relevant = relevant_patches(target, patches)
    backup = _Backup(target)
    saved = backup.states()
    if saved and "other" not in saved.values():
        todo = [rel for rel, state in saved.items() if state == "patched"]
        originals = {rel: backup.original(rel) for rel in todo}
        modes = {rel: backup.state[rel]["mode"] for rel in todo}
        _write_files(target, originals, modes, "revert")
        try:
            backup.remove()
        except OSError as exc:
            raise ToolError(
                f"revert restored every file, but could not remove {backup.dir}: {exc}"
            ) from exc
        if not todo:
            return "not applied; removed the saved originals that an interrupted run left"
        return (
            f"reverted {len(relevant)} patch(es): restored the saved original bytes and modes "
            f"of {len(todo)} file(s)"
        )
    rows, overall = status(target)
    if overall == NOT_APPLIED:
        return "not applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "revert"))
    # Applied, or the first patches only, without saved originals: reverse what is applied.
    applied = _applied_count(rows, relevant)
    contents = {}
    simulate(target, relevant[:applied][::-1], "-R", contents=contents)
    contents = {
        rel: data for rel, data in contents.items() if data != (target.root / rel).read_bytes()
    }
    _write_files(target, contents, _modes(target, contents), "revert")
    shutil.rmtree(backup.dir, ignore_errors=True)  # originals of another TE, if any
    return f"reverted {applied} patch(es)"


def _revert_checkout(target, patches):
    _, overall = status(target)
    if overall == NOT_APPLIED:
        return "not applied; nothing to do"
    subjects = [_subject(p) for p in patches]
    log = git(["log", "--format=%s", f"-{len(patches)}"], target.root).stdout.splitlines()
    if list(reversed(log)) != subjects:
        raise ToolError(
            "the series' commits are not the newest commits of the checkout; "
            "revert them with git revert"
        )
    git(["reset", "-q", "--keep", f"HEAD~{len(patches)}"], target.root)
    return f"removed the {len(patches)} commits of the series"


def _version_note(target):
    pin, found = load_pin(), te_version(target)
    if found is None or found == pin["version"]:
        return ""
    return f" (note: found TE {found}; the series is made and tested for {pin['version']})"


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
    pin, found = load_pin(), te_version(target)
    if found is not None and found != pin["version"]:
        lead = f"found TE {found} at {target.root}; this series is made for TE {pin['version']}"
        advice = (
            f"install TE {pin['version']} (pip install 'transformer_engine[pytorch]=="
            f"{pin['version']}') and run {action} again"
        )
    else:
        lead = f"{target} has drifted from what the series expects (TE {pin['version']})"
        advice = (
            f"its files were changed by something else: reinstall TE {pin['version']} "
            f"(pip install --force-reinstall --no-deps 'transformer_engine=={pin['version']}')"
            f" and run {action} again"
        )
    if target.kind == "checkout":
        advice = f"check out the pinned main commit {pin['main']['commit']} and run {action} again"
    lines = [f"cannot {action}: {lead}"]
    lines += [f"  {name}: {state} {detail}".rstrip() for name, state, detail in rows]
    lines.append(f"What to do: {advice}.")
    return "\n".join(lines)
