"""What the tool tells a user about a target beyond the patches' states: what each file the
series changes is, what status prints besides the patches (text and JSON), the notes, why
apply or revert refuse, and the diff that apply --dry-run shows."""

import difflib

from .saved import sha256
from .series import load_checksums
from .state import NOT_APPLIED, NOT_FOR_TARGET
from .target import older_than_supported, supported_range, te_version
from .upstream import load_pin

EDITED = (
    "changed after apply patched it: neither the original bytes that apply saved nor as this "
    "series patches them"
)


NOT_PRISTINE = (
    "edited or patched by something else, and not patched by this series; apply keeps those "
    "changes, and revert gives these bytes back"
)


def file_report(state, overall=None):
    """[(path, what it is)] for the upstream files the series changes: the pinned release's
    file (by its sha256 in patches/checksums), as this series makes it (from the state), and,
    where it is neither (as on another TE version), by what the series does to it (`overall`,
    default: the state's)."""
    if state.target.leftover:
        return [(rel, "missing (TE was uninstalled)") for rel in sorted(load_checksums())]
    overall = overall or state.overall
    pinned, found = load_pin()["version"], state.te_version
    other = found if found and found != pinned else None
    patched = state.patched_files(overall)
    report = []
    for rel, (released, _) in sorted(load_checksums().items()):
        digest = sha256(state.files.get(rel))
        if rel in state.edited:
            report.append((rel, EDITED + " (the saved originals are kept)"))
        elif digest is None:
            report.append((rel, "missing"))
        elif digest == released:
            report.append((rel, f"as released in TE {pinned}"))
        elif rel in patched and (patched[rel] == released or other):
            report.append(
                (
                    rel,
                    f"TE {pinned if patched[rel] == released else other}'s, patched by this series",
                )
            )
        elif rel in patched:  # edited before apply, on the pinned release
            report.append(
                (
                    rel,
                    (
                        "patched by this series over a file that was not as released in TE"
                        f" {pinned} (revert gives that file back)"
                    ),
                )
            )
        elif (state.saved or {}).get(rel) == "patched" and state.other_version:
            report.append((rel, "patched by another version of this series; apply replaces it"))
        elif overall == NOT_APPLIED and other:
            report.append((rel, f"as released in TE {other}"))
        elif overall == NOT_APPLIED:  # the series applies, but not to the release's bytes
            report.append((rel, f"not as released in TE {pinned}: {NOT_PRISTINE}"))
        else:
            report.append(
                (
                    rel,
                    f"neither as released in TE {pinned} nor as this series patches that"
                    + (f"; the TE here is {other}" if other else "")
                    + ": edited, patched by something else, or of a release that the series "
                    "does not apply to",
                )
            )
    return report


def notes(state, overall):
    """What the user should know beyond the state: an installed TE that is a git checkout's;
    TE reinstalled or upgraded over an apply; files edited after apply patched them."""
    found = [
        note
        for note in (source_checkout_refusal(state.target, "apply"), edited_note(state))
        if note
    ]
    saved = state.saved
    if overall != NOT_APPLIED or not saved or "patched" in saved.values():
        return found
    then, now = (state.backup.meta or {}).get("te_version"), state.te_version
    change = f" (TE {then} then, TE {now} now)" if then and now and then != now else ""
    return found + [
        f"the series was applied here and is not now{change}: TE was reinstalled or upgraded "
        "since (which undoes it), or an apply was stopped before it changed a file. Run apply "
        "again; it is idempotent: run it after every install or upgrade of TE"
    ]


def edited_note(state):
    """The note on the files edited after apply patched them, if any."""
    if state.edited:
        return f"{', '.join(state.edited)} {EDITED}: {_discard_edits(state.target)}"
    return None


def source_checkout_refusal(target, action):
    """Why `action` refuses an installed TE whose files are a git checkout's (it would change
    that checkout's working tree), with the command that does it there (as commits, with git
    am, where the checkout is TE's own); None for another target."""
    top = target.source_checkout
    if top is None:
        return None
    lead = (
        f"the TE at {target.root} is installed from a git checkout: its {target.subtree}/ is "
        f"tracked by the git repository {top}, and {action} {target.args} would change that "
        "repository's working tree"
    )
    if top == target.root:
        how = "as commits (git am; revert removes them)" if action == "apply" else ""
        return f"{lead}; {action} it there {how}: te-fusedadam-offload {action} {top}"
    return (
        f"{lead}; to change its files in place all the same, name the directory: "
        f"te-fusedadam-offload {action} {target.root}"
    )


def status_lines(state, overall):
    """What status prints after the patches: how many are left out, each file, the notes."""
    left_out = sum(what == NOT_FOR_TARGET for _, what, _ in state.rows)
    lines = []
    if left_out:
        lines.append(
            f"  ({len(state.rows) - left_out} of the series' {len(state.rows)} patches change "
            f"{state.target.subtree}/; the others are TE's tests and docs)"
        )
    lines += [f"  {rel}: {what}" for rel, what in file_report(state)]
    return lines + [f"note: {note}" for note in notes(state, overall)]


def status_json(state):
    """What status --json prints: the report as one object."""
    target, rows, overall = state.target, state.rows, state.overall
    return {
        "target": str(target.root),
        "kind": target.kind,
        "te_version": state.te_version,
        "series_for": load_pin()["version"],
        "status": overall,
        "patches": [{"patch": name, "state": what, "detail": why} for name, what, why in rows],
        "files": [{"path": rel, "state": what} for rel, what in file_report(state)],
        "notes": notes(state, overall),
    }


def _discard_edits(target):
    """How to take out a series whose files were edited after apply, dropping the edits."""
    return (
        f"'te-fusedadam-offload revert --discard-edits {target.args}' writes the saved "
        "originals back (what was changed after apply is lost; copy the file first to keep it)"
    )


# Why apply or revert refuses, beside drift (drift_message) and a source install
# (source_checkout_refusal).


def other_version_refusal(target, label, where):
    """This version does not apply to the originals saved with another version (`label`: the
    patch that stops, `where`: where)."""
    return (
        f"{target.subtree}/ carries another version of this series, and this version does not "
        f"apply to the original files saved with it ({label}: {where}); nothing was changed. "
        "'revert' restores the originals."
    )


def compat_refusal(target, found):
    """A checkout of a release (`found`) that needs the compat patch first."""
    return (
        f"{target.root} is a checkout of TE {found}, which needs a compat patch before the "
        "series: a checkout gets the series as commits from TE 2.17.0 on; patch its files in "
        "place instead (te-fusedadam-offload apply --installed, or a copy of its "
        f"{target.subtree}/ directory)"
    )


def uncommitted_refusal(target, changed=()):
    """A checkout with uncommitted changes (to any tracked file, or to those of `changed`)."""
    if not changed:
        return f"{target.root} has uncommitted changes; commit or stash them first"
    return (
        f"{target.root} has uncommitted changes to files of the series ({', '.join(changed)}); "
        "commit or stash them first"
    )


NOT_NEWEST = (
    "the series' commits are not the newest commits of the checkout; revert them with git revert"
)


def needs_git(target, changed, exc):
    """revert of `changed` files, neither as apply wrote them nor the saved originals, without
    git (`exc`), which tells an edit from a reinstall."""
    return (
        f"{', '.join(changed)}: neither as apply wrote it nor the original that it saved; telling "
        f"an edit from a reinstall of TE needs git ({exc}); or 'te-fusedadam-offload revert "
        f"--discard-edits {target.args}' writes the saved originals back"
    )


def drift_message(target, rows, action, edited=(), saved=True, found=None):
    """Why `action` (apply, revert) cannot go on, the rows of the patches, and what to do;
    `saved`: whether apply saved originals there (revert writes back only those); `found`: the
    TE release there (read if not given)."""
    pin, found = load_pin(), found or te_version(target)
    oldest, pinned = supported_range()
    supported = f"TE {oldest} to {pinned}" if oldest != pinned else f"TE {pinned}"
    pip = f"{target.python or 'python'} -m pip install"
    if older_than_supported(found):
        lead = (
            f"found TE {found} at {target.root}; this series supports {supported} (made and "
            f"tested for {pinned}): the FusedAdam code it builds on differs in older releases"
        )
    elif found is not None and found != pinned:
        lead = f"found TE {found} at {target.root}; this series is made for TE {pinned}"
    else:
        lead = f"{target} has drifted from what the series expects (TE {pinned})"
    if edited:
        lead = f"{', '.join(edited)} {EDITED}"
        advice = _discard_edits(target) + (", then run apply again" if action == "apply" else "")
    elif target.kind == "checkout":
        advice = f"check out the pinned main commit {pin['main']['commit']} and run {action} again"
    elif target.kind == "tree":
        advice = (
            f"put the files of a supported TE ({supported}) there, unchanged (e.g. unpack its "
            f"release wheel), or point at such a tree, and run {action} again"
        )
    elif found is not None and found != pinned:
        advice = (
            f"install TE {pinned} ({pip} 'transformer_engine[pytorch]=={pinned}') and run "
            f"{action} again"
        )
    else:
        advice = (
            f"its files were changed by something else: reinstall TE {pinned} ({pip} "
            f"--force-reinstall --no-deps 'transformer_engine=={pinned}') and run {action} again"
        )
    if action == "revert" and not saved and target.kind != "checkout":
        instead = advice.removeprefix("its files were changed by something else: ")
        # apply saved no originals here: it did not patch these files.
        advice = (
            "nothing; revert writes back the originals that apply saved, and it saved none of "
            "these files: it did not patch them, and nothing was changed"
        )
        if found is None or found == pinned:
            advice += (
                ". For the released files instead (which discards what was changed in them): "
                + instead.removesuffix(f" and run {action} again").rstrip(",")
            )
    lines = [f"cannot {action}: {lead}"]
    lines += [
        f"  {name}: {state}" + (f" ({detail})" if detail else "")
        for name, state, detail in rows
        if state != NOT_FOR_TARGET
    ]
    lines.append(f"What to do: {advice}.")
    return "\n".join(lines)


def unified_diff(files, contents):
    """A unified diff (a/ and b/ paths) from `files` to `contents` ({path: bytes})."""
    out = []
    for rel, data in sorted(contents.items()):
        before = files.get(rel) or b""
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
