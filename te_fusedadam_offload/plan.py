"""What apply and revert do to a target, decided from its State (state.py) alone: a Plan, which
actions.py carries out and preview.py shows (apply --dry-run, check). Nothing here reads or
writes the target: what a decision needs, the State has read.

A plan is its steps, in order; the line that the command prints once they are done; or, where
the command refuses, the error that it raises instead, once the steps are done (the tidying
only, where a refusal comes after it). What apply saved that this user cannot read is refused
in one place, Backup.refuse_unreadable (saved.py), when the State reads the originals and, in
_checked, for a plan that writes over them or removes them, and for any revert."""

from collections import namedtuple
from dataclasses import dataclass, field

from . import report
from .errors import NeedsError, ToolError
from .patching import all_apply, failure, touched
from .saved import sha256
from .series import commit_subject, patch_label
from .state import APPLIED, DRIFTED, NOT_APPLIED
from .target import BACKUP_DIR, older_than_supported
from .upstream import load_pin

ALREADY = "already applied; nothing to do"

# The steps of a plan, which actions.py carries out in order:
# - Tidy(dirs, saved): remove the temporary files that a killed run left in `dirs`, and, if
#   `saved`, saved originals that no state file counts;
# - Write(contents, modes, before, action): write {path: bytes} over the target's files with
#   `modes`, each atomically; a failure says what they are, read back against `before` (their
#   digests as read), naming `action`;
# - Save(originals, write, patches, te_version): apply's commit: save the originals, then
#   state.json (last), then `write`; if that fails before any file was replaced, the saved
#   originals are removed;
# - Forget(failure): remove the saved originals, state.json first; a failure raises `failure`
#   with the error ("": the error as it is);
# - Drop(leftover): remove the saved originals' directory, ignoring errors; `leftover` (TE
#   uninstalled): not ignoring them, then transformer_engine/ if that leaves it empty;
# - GitAm(patches, include), GitReset(count): a checkout's commits, made or taken out.
Tidy = namedtuple("Tidy", "dirs saved")
Write = namedtuple("Write", "contents modes before action")
Save = namedtuple("Save", "originals write patches te_version")
Forget = namedtuple("Forget", "failure", defaults=("",))
Drop = namedtuple("Drop", "leftover", defaults=(False,))
GitAm = namedtuple("GitAm", "patches include")
GitReset = namedtuple("GitReset", "count")


@dataclass
class Plan:
    """What `action` (apply, revert) does to `target`: see the module's docstring."""

    target: object
    action: str
    steps: list = field(default_factory=list)
    message: str = ""
    refusal: Exception = None


def apply_plan(state, dry=False):
    """apply: a no-op if the series is applied; else the files that it changes, written one by
    one, each atomically, after the originals were saved (so that the next apply completes an
    interrupted one); a git checkout gets the series as commits (`dry`: as the dry run says it,
    without the checks that git am needs)."""
    target = state.target
    if target.kind == "checkout":
        return _apply_checkout(state, dry)
    if target.leftover:
        target.refuse_leftover()
    if state.source_checkout:
        return _refused(state, "apply", ToolError(report.source_checkout_refusal(target, "apply")))
    if state.saved and set(state.saved.values()) == {"original"}:  # they restore nothing
        forgotten = state.forgetting_saved()
        return _checked(state, _tidied(state, "apply", [Forget()], _apply, forgotten))
    return _checked(state, _tidied(state, "apply", [], _apply, state))


def _apply(state):
    target = state.target
    if state.from_saved:  # what apply saved is there: this version's, or another's
        return _complete(state) if state.this_version else _replace_other_version(state)
    if state.overall == APPLIED:
        return Plan(target, "apply", message=ALREADY)
    if state.overall == DRIFTED or older_than_supported(state.te_version):
        why = report.drift_message(
            target, state.rows, "apply", state.edited, found=state.te_version
        )
        return _refused(state, "apply", ToolError(why))
    originals, contents = state.changes()
    write = Write(contents, {rel: state.modes[rel] for rel in contents}, _digests(state), "apply")
    done = f"applied {len(state.relevant) - state.applied} patch(es) to {target.subtree}/"
    if state.applied:
        done += f" (the first {state.applied} were applied already)"
    if state.saved:
        done += " (TE was reinstalled or upgraded since the last apply: saved its files afresh)"
    pin = load_pin()["version"]
    if state.te_version not in (None, pin):
        done += f" (note: found TE {state.te_version}; the series is made and tested for {pin})"
    return Plan(target, "apply", [Save(originals, write, state.relevant, state.te_version)], done)


def _complete(state):
    """Write the files that an interrupted apply of this version left original."""
    todo = [rel for rel, s in state.saved.items() if s == "original"]
    if not todo:
        return Plan(state.target, "apply", message=ALREADY)
    contents, modes = state.after_saved(), {rel: state.backup.mode(rel) for rel in todo}
    write = Write({rel: contents[rel] for rel in todo}, modes, _digests(state), "apply")
    done = f"completed an interrupted apply ({len(todo)} file(s) written)"
    return Plan(state.target, "apply", [write], done)


def _replace_other_version(state):
    """The target carries another version of the series (applied by another release of this
    tool, whose saved originals are there): put the originals back and apply this version,
    if it applies to them; else change nothing."""
    results = state.saved_results()
    if not all_apply(results):
        patch, result = results[-1]
        why = report.other_version_refusal(state.target, patch_label(patch), failure(result, patch))
        return _refused(state, "apply", ToolError(why))
    undo = _restore_saved(state)
    try:  # apply as the originals are, once back
        redo = _apply(state.forgetting_saved(undo.steps[0].contents, undo.steps[0].modes))
    except ToolError as exc:
        redo = _refused(state, "apply", exc)
    done = f"replaced another version of the series ({undo.message}): {redo.message}"
    return Plan(state.target, "apply", undo.steps + redo.steps, done, redo.refusal)


def _apply_checkout(state, dry):
    target, patches = state.target, state.relevant
    if state.overall == APPLIED:
        return Plan(target, "apply", message=ALREADY)
    if state.overall == DRIFTED:
        return _refused(
            state, "apply", ToolError(report.drift_message(target, state.rows, "apply"))
        )
    if dry:
        return Plan(
            target,
            "apply",
            [GitAm(patches, state.include)],
            f"would apply {len(patches)} patches as commits with git am",
        )
    if state.uncommitted():
        return _refused(state, "apply", ToolError(report.uncommitted_refusal(target)))
    if any(p not in state.series for p in patches):  # a compat patch: no commit message
        return _refused(state, "apply", ToolError(report.compat_refusal(target, state.te_version)))
    done = f"applied {len(patches)} patches as commits with git am"
    if target.release_checkout:
        done += (
            f": their changes to {target.subtree}/ (the series' tests and docs are made against "
            "TE main)"
        )
    return Plan(target, "apply", [GitAm(patches, state.include)], done)


def revert_plan(state, discard_edits=False):
    """revert: a no-op if the series is not applied. The saved originals are written back with
    their modes; without them (a TE patched otherwise), the series is reversed. A file changed
    after apply patched it is refused, unless `discard_edits`: then its saved original is
    written back too, and the message names it. A git checkout loses the series' commits."""
    target = state.target
    if target.kind == "checkout":
        return _revert_checkout(state)
    if target.leftover:
        done = (
            "TE is not installed here; removed the original files that apply had saved, left "
            f"behind in {target.subtree}/{BACKUP_DIR}/ when TE was uninstalled"
        )
        return _checked(state, Plan(target, "revert", [Drop(leftover=True)], done))
    return _checked(state, _tidied(state, "revert", [], _revert, state, discard_edits))


def _revert(state, discard_edits):
    target = state.target
    if state.from_saved:  # also in a source checkout, where an earlier version applied it so
        return _restore_saved(state)
    changed = state.changed_since_apply()  # the saved originals are written back without git
    if changed and discard_edits:
        return _restore_saved(state, discard=changed)
    try:
        overall = state.overall
    except NeedsError as exc:
        if not changed:
            raise
        raise NeedsError(report.needs_git(target, changed, exc)) from exc
    if overall == NOT_APPLIED and state.saved:  # of a TE reinstalled or upgraded since
        done = (
            "not applied (TE was reinstalled or upgraded since the last apply); removed the "
            "original files saved then"
        )
        return Plan(target, "revert", [Forget(f"could not remove {state.backup.dir}")], done)
    if overall == NOT_APPLIED:
        return Plan(target, "revert", message="not applied; nothing to do")
    refusal = state.source_checkout and report.source_checkout_refusal(target, "revert")
    if refusal or overall == DRIFTED:
        saved, found = bool(state.saved), state.te_version
        why = refusal or report.drift_message(
            target, state.rows, "revert", state.edited, saved, found
        )
        return _refused(state, "revert", ToolError(why))
    # Applied, or the first patches only, without saved originals: reverse what is applied,
    # then remove what apply saved of another TE, if anything.
    contents = {rel: data for rel, data in state.before.items() if data != state.files.get(rel)}
    write = Write(contents, {rel: state.modes[rel] for rel in contents}, _digests(state), "revert")
    return Plan(target, "revert", [write, Drop()], f"reverted {state.applied} patch(es)")


def _restore_saved(state, discard=()):
    """Write the saved originals back over the files that are patched (and those of
    `discard`, changed after the apply), and forget them."""
    backup = state.backup
    count = len(backup.patches() or ())  # how many patches made the saved state, if it says
    todo = [rel for rel, s in state.saved.items() if s == "patched" or rel in discard]
    originals, modes = backup.originals(), {rel: backup.mode(rel) for rel in todo}
    write = Write({rel: originals[rel] for rel in todo}, modes, _digests(state), "revert")
    steps = [write, Forget(f"revert restored every file, but could not remove {backup.dir}")]
    if not todo:
        done = "not applied; removed the saved originals that an interrupted run left"
        return Plan(state.target, "revert", steps, done)
    done = (
        f"reverted {f'{count} patch(es)' if count else 'the series'}: restored the saved "
        f"original bytes and modes of {len(todo)} file(s)"
    )
    if discard:
        done += f"; discarded what was changed after apply in {', '.join(discard)}"
    return Plan(state.target, "revert", steps, done)


def _revert_checkout(state):
    target, patches = state.target, state.relevant
    if state.overall == NOT_APPLIED:
        return Plan(target, "revert", message="not applied; nothing to do")
    if state.newest_commits(len(patches)) != [commit_subject(p) for p in patches]:
        return _refused(state, "revert", ToolError(report.NOT_NEWEST))
    # Where git reset --keep would stop: changes to the files that the series' commits change.
    changed = state.uncommitted(*sorted({path for patch in patches for path in touched(patch)}))
    if changed:
        return _refused(state, "revert", ToolError(report.uncommitted_refusal(target, changed)))
    done = f"removed the {len(patches)} commits of the series"
    return Plan(target, "revert", [GitReset(len(patches))], done)


def tidying(state):
    """The plan that removes what a killed run left, and nothing else."""
    return Plan(state.target, "apply", [_tidy(state)])


def _tidy(state):
    dirs = {(state.target.root / rel).parent for rel in state.files} | {state.backup.dir}
    return Tidy(sorted(dirs), state.backup.stale)


def _tidied(state, action, steps, decide, *args):
    """The plan `decide(*args)` of `action` after tidying and `steps`; an error in deciding is
    raised after them too."""
    try:
        plan = decide(*args)
    except ToolError as exc:
        plan = _refused(state, action, exc)
    plan.steps[:0] = [_tidy(state), *steps]
    return plan


def _checked(state, plan):
    """Where what apply saved cannot be read by this user, the plan that needs it is refused
    (Backup.refuse_unreadable), changing nothing but the tidying: any revert (it writes it
    back or removes it); an apply that saves over it or removes it."""
    if plan.action == "revert" or any(isinstance(s, (Save, Forget, Drop)) for s in plan.steps):
        try:
            state.backup.refuse_unreadable(plan.action)
        except ToolError as exc:
            tidy = [step for step in plan.steps if isinstance(step, Tidy)]
            return Plan(plan.target, plan.action, tidy, refusal=exc)
    return plan


def _refused(state, action, exc):
    return Plan(state.target, action, refusal=exc)


def _digests(state):
    """The digests of the target's files as the State read them."""
    return {rel: sha256(data) for rel, data in state.files.items()}
