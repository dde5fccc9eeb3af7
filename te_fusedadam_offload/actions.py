"""apply, revert and apply --dry-run on a target, from its State (state.py), found once.

An installed TE or a directory gets the series' changes file by file, atomically, after the
originals were saved (saved.py); a TE git checkout gets the series as commits (git am)."""

import difflib
import re
import shutil
import tempfile
from pathlib import Path

from .errors import NeedsError, ToolError
from .patching import all_apply, failure, git, git_am, touched
from .saved import BACKUP_DIR, Backup, modes, remove_stale_files, replace_files, write_files
from .series import compat_patches, patch_files, patch_label
from .report import drift_message
from .state import APPLIED, DRIFTED, NOT_APPLIED, State
from .target import Target, older_than_supported, te_version
from .upstream import load_pin


def apply(target, patches=None):
    """Apply the series (or `patches`, a prefix of it); a no-op if applied. Every file is
    replaced atomically, after the originals were saved, so an interrupted apply is completed
    by the next one."""
    if target.kind == "checkout":
        return _apply_checkout(State(target, patches))
    state = _state_to_change(target, patches)
    if state.from_saved:  # what apply saved is there: this version's, or another's
        return _complete(state) if state.this_version else _replace_other_version(state)
    if state.overall == APPLIED:
        return "already applied; nothing to do"
    if state.overall == DRIFTED or older_than_supported(te_version(target)):
        raise ToolError(drift_message(target, state.rows, "apply", state.edited))
    state.backup.refuse_unreadable("apply")  # it would write over what it cannot read
    originals, contents = state.changes()
    replace_files(state.backup, originals, contents, state.relevant)
    done = f"applied {len(state.relevant) - state.applied} patch(es) to {target.subtree}/"
    if state.applied:
        done += f" (the first {state.applied} were applied already)"
    if state.saved:
        done += " (TE was reinstalled or upgraded since the last apply: saved its files afresh)"
    return done + _version_note(target)


def _state_to_change(target, patches):
    """The State of an installed TE or a directory that apply is about to change, after the
    checks that it may (not only what an uninstall left, not a git checkout's files) and
    without what a killed run left: temporary files, and saved originals that restore nothing
    (no file is patched: TE was reinstalled since, or an apply stopped before it replaced a
    file)."""
    target.refuse_leftover()
    target.refuse_source_checkout("apply")
    remove_stale_files(target)
    state = State(target, patches)
    if state.saved and set(state.saved.values()) == {"original"}:
        state.backup.refuse_unreadable("apply")
        state.backup.remove()
        state = State(target, patches)
    return state


def _complete(state):
    """Write the files that an interrupted apply of this version left original."""
    todo = [rel for rel, s in state.saved.items() if s == "original"]
    if not todo:
        return "already applied; nothing to do"
    state.backup.refuse_unreadable("apply")
    contents = state.after_saved()
    file_modes = {rel: state.backup.state[rel]["mode"] for rel in todo}
    write_files(state.target, {rel: contents[rel] for rel in todo}, file_modes, "apply")
    return f"completed an interrupted apply ({len(todo)} file(s) written)"


def _replace_other_version(state):
    """The target carries another version of the series (applied by another release of this
    tool, whose saved originals are there): put the originals back and apply this version,
    if it applies to them; else change nothing."""
    target, results = state.target, state.saved_results()
    if not all_apply(results):
        patch, result = results[-1]
        raise ToolError(
            f"{target.subtree}/ carries another version of this series, and this version does "
            f"not apply to the original files saved with it ({patch_label(patch)}: "
            f"{failure(result, patch)}); nothing was changed. 'revert' restores the originals."
        )
    undone = _restore_saved(state)
    return f"replaced another version of the series ({undone}): {apply(target, state.series)}"


def _apply_checkout(state):
    if state.overall == APPLIED:
        return "already applied; nothing to do"
    if state.overall == DRIFTED:
        raise ToolError(drift_message(state.target, state.rows, "apply"))
    target, root, patches = state.target, state.target.root, state.relevant
    if git(["status", "--porcelain", "--untracked-files=no"], root).stdout.strip():
        raise ToolError(f"{root} has uncommitted changes; commit or stash them first")
    if any(p not in state.series for p in patches):  # a compat patch: no commit message
        raise ToolError(
            f"{root} is a checkout of TE {te_version(target)}, which needs a compat patch before "
            "the series: a checkout gets the series as commits from TE 2.17.0 on; patch its "
            "files in place instead (te-fusedadam-offload apply --installed, or a copy of "
            f"its {target.subtree}/ directory)"
        )
    git_am(root, patches, include=target.include)
    if target.release_checkout:
        return (
            f"applied {len(patches)} patches as commits with git am: their changes to "
            f"{target.subtree}/ (the series' tests and docs are made against TE main)"
        )
    return f"applied {len(patches)} patches as commits with git am"


def revert(target, discard_edits=False):
    """Take the series out again; a no-op if it is not applied. The saved originals are
    written back with their modes; without them (a TE patched otherwise), the series is
    reversed. A file changed after apply patched it is refused, unless `discard_edits`: then
    its saved original is written back too, and the message names it."""
    if target.kind == "checkout":
        return _revert_checkout(State(target))
    if target.leftover:
        Backup(target).refuse_unreadable("revert")
        shutil.rmtree(target.root / target.subtree / BACKUP_DIR)
        if not any((target.root / target.subtree).iterdir()):
            (target.root / target.subtree).rmdir()
        return (
            "TE is not installed here; removed the original files that apply had saved, left "
            f"behind in {target.subtree}/{BACKUP_DIR}/ when TE was uninstalled"
        )
    remove_stale_files(target)
    state = State(target)
    state.backup.refuse_unreadable("revert")
    if state.from_saved:  # also in a source checkout, where an earlier version applied it so
        return _restore_saved(state)
    changed = state.changed_since_apply()  # the saved originals are written back without git
    if changed and discard_edits:
        return _restore_saved(state, discard=changed)
    try:
        state.overall  # pylint: disable=pointless-statement
    except NeedsError as exc:
        if not changed:
            raise
        raise NeedsError(
            f"{', '.join(changed)}: neither as apply wrote it nor the original that it saved; "
            f"telling an edit from a reinstall of TE needs git ({exc}); or 'te-fusedadam-offload "
            f"revert --discard-edits {target.args}' writes the saved originals back"
        ) from exc
    if state.overall == NOT_APPLIED:
        if state.saved:  # of a TE that was reinstalled or upgraded since: they restore nothing now
            try:
                state.backup.remove()
            except OSError as exc:
                raise ToolError(f"could not remove {state.backup.dir}: {exc}") from exc
            return (
                "not applied (TE was reinstalled or upgraded since the last apply); removed the "
                "original files saved then"
            )
        return "not applied; nothing to do"
    target.refuse_source_checkout("revert")
    if state.overall == DRIFTED:
        raise ToolError(
            drift_message(target, state.rows, "revert", state.edited, saved=bool(state.saved))
        )
    # Applied, or the first patches only, without saved originals: reverse what is applied.
    contents = {
        rel: data for rel, data in state.before.items() if data != (target.root / rel).read_bytes()
    }
    write_files(target, contents, modes(target, contents), "revert")
    shutil.rmtree(state.backup.dir, ignore_errors=True)  # originals of another TE, if any
    return f"reverted {state.applied} patch(es)"


def _restore_saved(state, discard=()):
    """Write the saved originals back over the files that are patched (and those of
    `discard`, changed after the apply), and forget them."""
    target, backup = state.target, state.backup
    count = len(backup.patches() or ())  # how many patches made the saved state, if it says
    todo = [rel for rel, s in state.saved.items() if s == "patched" or rel in discard]
    originals = {rel: backup.original(rel) for rel in todo}
    write_files(target, originals, {rel: backup.state[rel]["mode"] for rel in todo}, "revert")
    try:
        backup.remove()
    except OSError as exc:
        raise ToolError(
            f"revert restored every file, but could not remove {backup.dir}: {exc}"
        ) from exc
    if not todo:
        return "not applied; removed the saved originals that an interrupted run left"
    done = (
        f"reverted {f'{count} patch(es)' if count else 'the series'}: restored the saved "
        f"original bytes and modes of {len(todo)} file(s)"
    )
    if discard:
        done += f"; discarded what was changed after apply in {', '.join(discard)}"
    return done


def _revert_checkout(state):
    if state.overall == NOT_APPLIED:
        return "not applied; nothing to do"
    patches, root = state.relevant, state.target.root
    subjects = [_subject(p) for p in patches]
    log = git(["log", "--format=%s", f"-{len(patches)}"], root).stdout.splitlines()
    if list(reversed(log)) != subjects:
        raise ToolError(
            "the series' commits are not the newest commits of the checkout; "
            "revert them with git revert"
        )
    # Where git reset --keep would stop: changes to the files that the series' commits change.
    paths = sorted({path for patch in patches for path in touched(patch)})
    status = ["status", "--porcelain", "--untracked-files=no", "--ignore-submodules=all"]
    changed = [line[3:] for line in git([*status, "--", *paths], root).stdout.splitlines()]
    if changed:
        files = ", ".join(changed)
        raise ToolError(
            f"{root} has uncommitted changes to files of the series ({files}); commit or stash "
            "them first"
        )
    git(["reset", "-q", "--keep", f"HEAD~{len(patches)}"], root, shielded=True)
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


def dry_run(target, patches=None):
    """(what apply would say, the unified diff of what it would change): apply runs on a
    scratch copy of the files it reads; the target is not touched."""
    if target.kind == "checkout":
        state = State(target, patches)
        if state.overall == APPLIED:
            return "already applied; nothing to do", ""
        if state.overall == DRIFTED:
            raise ToolError(drift_message(target, state.rows, "apply"))
        contents = state.after if state.overall == NOT_APPLIED else {}
        return f"would apply {len(state.relevant)} patches as commits with git am", _diff(
            target.root, contents
        )
    target.refuse_leftover()
    target.refuse_source_checkout("apply")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        package = target.root / target.subtree
        changed = {rel for p in patch_files() + compat_patches() for rel in target.touches(p)}
        reads = changed | {f"{target.subtree}/__init__.py"}
        reads.update(str(m.relative_to(target.root)) for m in target.root.glob("*.dist-info/*"))
        for rel in reads:
            if (target.root / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(target.root / rel, scratch / rel)
        (scratch / target.subtree).mkdir(parents=True, exist_ok=True)
        _copy_readable(package / BACKUP_DIR, scratch / target.subtree / BACKUP_DIR)
        copy = Target(scratch, target.kind, target.python)
        copy.unreadable_backup = Backup(target).unreadable  # as apply would find it
        try:
            message = apply(copy, patches).replace(str(copy.root), str(target.root))
        except ToolError as exc:
            raise type(exc)(str(exc).replace(str(copy.root), str(target.root))) from None
        contents = {
            rel: (scratch / rel).read_bytes() for rel in changed if (scratch / rel).is_file()
        }
        return message, _diff(target.root, contents)


def _copy_readable(src, dst):
    """Copy the files under `src` that this user can read to `dst` (what apply saved as
    another user may not be readable: Backup.unreadable says so to the copy)."""
    for path in sorted(src.rglob("*")):
        if path.is_file():
            try:
                data = path.read_bytes()
            except PermissionError:
                continue
            (dst / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / path.relative_to(src)).write_bytes(data)


def _diff(root, contents):
    """A unified diff (a/ and b/ paths) from the files under `root` to `contents`."""
    out = []
    for rel, data in sorted(contents.items()):
        path = Path(root) / rel
        before = path.read_bytes() if path.is_file() else b""
        if before == data:
            continue
        out.extend(
            difflib.unified_diff(
                before.decode("utf-8").splitlines(keepends=True),
                data.decode("utf-8").splitlines(keepends=True),
                f"a/{rel}",
                f"b/{rel}",
            )
        )
    return "".join(out)
