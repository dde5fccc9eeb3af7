"""What apply and revert do to a target, decided from its State (state.py) alone: a Plan, which
actions.py carries out, apply --dry-run shows as a diff and check sums up in one line. Nothing
here reads or writes the target: what a decision needs, the State read once.

A plan is its steps in order (Tidy, Write, Save, Forget, Drop on an installed TE or a
directory; GitAm, GitReset on a git checkout), the line that the command prints once they are
done, and, where the command refuses, the error that it raises instead (after the steps: only
the tidying, where a refusal comes after it). What apply saved that this user cannot read is
refused in one place, Backup.refuse_unreadable (saved.py): when the State reads the originals,
and, in _checked, for a plan that writes over them or removes them, and for any revert."""

from collections import namedtuple
from dataclasses import dataclass, field

from .errors import NeedsError, ToolError
from .patching import all_apply, failure, touched
from .report import drift_message, edited_note, source_checkout_refusal, unified_diff
from .saved import sha256
from .series import commit_subject, patch_label
from .state import APPLIED, DRIFTED, INTERRUPTED, NOT_APPLIED
from .target import BACKUP_DIR, older_than_supported
from .upstream import load_pin

ALREADY = "already applied; nothing to do"
APPLIED_WOULD = "nothing to do, the series is applied"
DRIFTED_WOULD = "refuses a drifted TE; status says what drifted"


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
    """What a command does to `target`: see the module's docstring. `would`: what apply would
    do, in a few words (check)."""

    target: object
    action: str
    steps: list = field(default_factory=list)
    message: str = ""
    refusal: Exception = None
    would: str = ""


def apply_plan(state):
    """apply: a no-op if the series is applied; else the files it changes, written one by one,
    each atomically, after the originals were saved (so that the next apply completes an
    interrupted one); a git checkout gets the series as commits."""
    target = state.target
    if target.kind == "checkout":
        return _apply_checkout(state)
    target.refuse_leftover()
    refusal = source_checkout_refusal(target, "apply")
    if refusal:
        return _refused(state, "apply", ToolError(refusal), f"refuses: {refusal}")
    if state.saved and set(state.saved.values()) == {"original"}:  # they restore nothing
        return _checked(
            state, _tidied(state, "apply", [Forget()], _apply, state.forgetting_saved())
        )
    return _checked(state, _tidied(state, "apply", [], _apply, state))


def _apply(state):
    target, args = state.target, state.target.args
    if state.from_saved:  # what apply saved is there: this version's, or another's
        return _complete(state) if state.this_version else _replace_other_version(state)
    if state.overall == APPLIED:
        return _nothing(state, "apply", ALREADY, APPLIED_WOULD)
    older = older_than_supported(state.te_version)
    if state.overall == DRIFTED or older:
        message = drift_message(target, state.rows, "apply", state.edited, found=state.te_version)
        would = DRIFTED_WOULD
        if state.edited:
            would = f"refuses: {edited_note(state)}"
        elif older:
            would = f"refuses TE {state.te_version}, older than the releases the series supports"
        return _refused(state, "apply", ToolError(message), would)
    originals, contents = state.changes()
    write = Write(contents, {rel: state.modes[rel] for rel in contents}, _digests(state), "apply")
    done = f"applied {len(state.relevant) - state.applied} patch(es) to {target.subtree}/"
    would = f"the series is not in: te-fusedadam-offload apply {args} puts it in"
    if state.applied:
        done += f" (the first {state.applied} were applied already)"
        would = f"completes the series: te-fusedadam-offload apply {args}"
    if state.saved:
        done += " (TE was reinstalled or upgraded since the last apply: saved its files afresh)"
    pin = load_pin()["version"]
    if state.te_version not in (None, pin):
        done += f" (note: found TE {state.te_version}; the series is made and tested for {pin})"
    save = Save(originals, write, state.relevant, state.te_version)
    return Plan(target, "apply", [save], done, would=would)


def _complete(state):
    """Write the files that an interrupted apply of this version left original."""
    todo = [rel for rel, s in state.saved.items() if s == "original"]
    if not todo:
        return _nothing(state, "apply", ALREADY, APPLIED_WOULD)
    contents = state.after_saved()
    modes = {rel: state.backup.mode(rel) for rel in todo}
    write = Write({rel: contents[rel] for rel in todo}, modes, _digests(state), "apply")
    done = f"completed an interrupted apply ({len(todo)} file(s) written)"
    would = f"completes the series: te-fusedadam-offload apply {state.target.args}"
    return Plan(state.target, "apply", [write], done, would=would)


def _replace_other_version(state):
    """The target carries another version of the series (applied by another release of this
    tool, whose saved originals are there): put the originals back and apply this version,
    if it applies to them; else change nothing."""
    target, results = state.target, state.saved_results()
    if not all_apply(results):
        patch, result = results[-1]
        return _refused(
            state,
            "apply",
            ToolError(
                f"{target.subtree}/ carries another version of this series, and this version "
                f"does not apply to the original files saved with it ({patch_label(patch)}: "
                f"{failure(result, patch)}); nothing was changed. 'revert' restores the "
                "originals."
            ),
            DRIFTED_WOULD,
        )
    undo = _restore_saved(state)
    restored = undo.steps[0]
    try:
        redo = _apply(state.forgetting_saved(restored.contents, restored.modes))
    except ToolError as exc:  # raised once the originals are back, as it was found then
        redo = _refused(state, "apply", exc)
    done = f"replaced another version of the series ({undo.message}): {redo.message}"
    would = "replaces the other version of this series that is applied with this one"
    return Plan(target, "apply", undo.steps + redo.steps, done, redo.refusal, would)


def _apply_checkout(state):
    target, overall, patches = state.target, state.overall, state.relevant
    if overall == APPLIED:
        return _nothing(state, "apply", ALREADY, APPLIED_WOULD)
    if overall == DRIFTED:
        return _refused(
            state, "apply", ToolError(drift_message(target, state.rows, "apply")), DRIFTED_WOULD
        )
    if state.uncommitted():
        refusal = f"{target.root} has uncommitted changes; commit or stash them first"
        return _refused(state, "apply", ToolError(refusal), f"refuses: {refusal}")
    if any(p not in state.series for p in patches):  # a compat patch: no commit message
        refusal = (
            f"{target.root} is a checkout of TE {state.te_version}, which needs a compat patch "
            "before the series: a checkout gets the series as commits from TE 2.17.0 on; patch "
            "its files in place instead (te-fusedadam-offload apply --installed, or a copy of "
            f"its {target.subtree}/ directory)"
        )
        return _refused(state, "apply", ToolError(refusal), f"refuses: {refusal}")
    done = f"applied {len(patches)} patches as commits with git am"
    if target.release_checkout:
        done += (
            f": their changes to {target.subtree}/ (the series' tests and docs are made against "
            "TE main)"
        )
    would = f"the series is not in: te-fusedadam-offload apply {target.args} puts it in"
    if overall == INTERRUPTED:
        would = f"completes the series: te-fusedadam-offload apply {target.args}"
    return Plan(target, "apply", [GitAm(patches, target.include)], done, would=would)


def revert_plan(state, discard_edits=False):
    """revert: a no-op if the series is not applied. The saved originals are written back with
    their modes; without them (a TE patched otherwise), the series is reversed. A file changed
    after apply patched it is refused, unless `discard_edits`: then its saved original is
    written back too, and the message names it. A git checkout loses the series' commits."""
    target = state.target
    if target.kind == "checkout":
        return _revert_checkout(state)
    if target.leftover:
        return _checked(
            state,
            Plan(
                target,
                "revert",
                [Drop(leftover=True)],
                "TE is not installed here; removed the original files that apply had saved, left "
                f"behind in {target.subtree}/{BACKUP_DIR}/ when TE was uninstalled",
            ),
        )
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
        raise NeedsError(
            f"{', '.join(changed)}: neither as apply wrote it nor the original that it saved; "
            f"telling an edit from a reinstall of TE needs git ({exc}); or 'te-fusedadam-offload "
            f"revert --discard-edits {target.args}' writes the saved originals back"
        ) from exc
    if overall == NOT_APPLIED and state.saved:  # of a TE reinstalled or upgraded since
        done = (
            "not applied (TE was reinstalled or upgraded since the last apply); removed the "
            "original files saved then"
        )
        return Plan(target, "revert", [Forget(f"could not remove {state.backup.dir}")], done)
    if overall == NOT_APPLIED:
        return _nothing(state, "revert", "not applied; nothing to do")
    refusal = source_checkout_refusal(target, "revert")
    if refusal:
        return _refused(state, "revert", ToolError(refusal))
    if overall == DRIFTED:
        message = drift_message(
            target, state.rows, "revert", state.edited, bool(state.saved), state.te_version
        )
        return _refused(state, "revert", ToolError(message))
    # Applied, or the first patches only, without saved originals: reverse what is applied.
    contents = {rel: data for rel, data in state.before.items() if data != state.files.get(rel)}
    modes = {rel: state.modes[rel] for rel in contents}
    write = Write(contents, modes, _digests(state), "revert")  # then originals of another TE
    return Plan(target, "revert", [write, Drop()], f"reverted {state.applied} patch(es)")


def _restore_saved(state, discard=()):
    """Write the saved originals back over the files that are patched (and those of
    `discard`, changed after the apply), and forget them."""
    backup = state.backup
    count = len(backup.patches() or ())  # how many patches made the saved state, if it says
    todo = [rel for rel, s in state.saved.items() if s == "patched" or rel in discard]
    originals = backup.originals()
    modes = {rel: backup.mode(rel) for rel in todo}
    write = Write({rel: originals[rel] for rel in todo}, modes, _digests(state), "revert")
    forget = Forget(f"revert restored every file, but could not remove {backup.dir}")
    if not todo:
        done = "not applied; removed the saved originals that an interrupted run left"
        return Plan(state.target, "revert", [write, forget], done)
    done = (
        f"reverted {f'{count} patch(es)' if count else 'the series'}: restored the saved "
        f"original bytes and modes of {len(todo)} file(s)"
    )
    if discard:
        done += f"; discarded what was changed after apply in {', '.join(discard)}"
    return Plan(state.target, "revert", [write, forget], done)


def _revert_checkout(state):
    target, patches = state.target, state.relevant
    if state.overall == NOT_APPLIED:
        return _nothing(state, "revert", "not applied; nothing to do")
    if state.newest_commits(len(patches)) != [commit_subject(p) for p in patches]:
        refusal = (
            "the series' commits are not the newest commits of the checkout; revert them with "
            "git revert"
        )
        return _refused(state, "revert", ToolError(refusal))
    # Where git reset --keep would stop: changes to the files that the series' commits change.
    changed = state.uncommitted(*sorted({path for patch in patches for path in touched(patch)}))
    if changed:
        refusal = (
            f"{target.root} has uncommitted changes to files of the series "
            f"({', '.join(changed)}); commit or stash them first"
        )
        return _refused(state, "revert", ToolError(refusal))
    done = f"removed the {len(patches)} commits of the series"
    return Plan(target, "revert", [GitReset(len(patches))], done)


def dry_run(state):
    """(what apply would say, the unified diff of what it would change): its plan, shown and
    not carried out. A checkout is not checked for uncommitted changes."""
    target = state.target
    if target.kind == "checkout":
        if state.overall == APPLIED:
            return ALREADY, ""
        if state.overall == DRIFTED:
            raise ToolError(drift_message(target, state.rows, "apply"))
        contents = state.after if state.overall == NOT_APPLIED else {}
        return f"would apply {len(state.relevant)} patches as commits with git am", unified_diff(
            state.files, contents
        )
    plan = apply_plan(state)
    if plan.refusal is not None:
        raise plan.refusal
    contents = {}
    for step in plan.steps:
        step = step.write if isinstance(step, Save) else step
        contents.update(step.contents if isinstance(step, Write) else {})
    return plan.message, unified_diff(state.files, contents)


def would_apply(state):
    """What apply would do, in a few words: its plan's, or the error that stops it."""
    try:
        return apply_plan(state).would
    except ToolError as exc:
        return f"refuses: {str(exc).splitlines()[0]}"


def tidying(state):
    """The plan that removes what a killed run left, and nothing else."""
    return Plan(state.target, "revert", [_tidy(state)])


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
    touches = any(isinstance(step, (Save, Forget, Drop)) for step in plan.steps)
    if plan.action == "revert" or touches:
        try:
            state.backup.refuse_unreadable(plan.action)
        except ToolError as exc:
            tidy = [step for step in plan.steps if isinstance(step, Tidy)]
            return Plan(plan.target, plan.action, tidy, refusal=exc, would=f"refuses: {exc}")
    return plan


def _nothing(state, action, message, would=""):
    return Plan(state.target, action, message=message, would=would)


def _refused(state, action, exc, would=""):
    return Plan(
        state.target, action, refusal=exc, would=would or f"refuses: {str(exc).splitlines()[0]}"
    )


def _digests(state):
    """The digests of the target's files as the State read them."""
    return {rel: sha256(data) for rel, data in state.files.items()}
