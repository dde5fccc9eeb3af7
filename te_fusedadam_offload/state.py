"""What the series is on a target, found once per command: the one answer to "is it applied?".

A State reads the digests that apply saved in state.json where they are there and were made by
this series (the patches it records, or the series applied to the saved originals, give
them); only without them does it apply the patches, in series order, to a scratch copy of the
target's files (forward: not applied; backward: applied). Each part is found when it is
first asked for, and once: the rows and overall state that status prints, which patches the
target takes (the compat patch its release needs first, if any), the files before and after
the series that apply and revert write, and whether another version of the series is there.
"""

import shutil
import tempfile
from functools import cached_property
from pathlib import Path

from .errors import ToolError, fault
from .patching import all_apply, failure, offsets
from .saved import Backup, patch_ids, sha256
from .series import compat_patches, patch_files, patch_label
from .target import Target, older_than_supported, supported_range, te_version

APPLIED, NOT_APPLIED, DRIFTED = "applied", "not applied", "drifted"
INTERRUPTED = "interrupted"
NOT_FOR_TARGET = "not for this target"
NOT_CHECKED = "not checked"


def _scratch_copy(target, files, originals, scratch):
    """A Target at `scratch` holding a copy of the target's `files` (or their `originals`)."""
    (scratch / target.subtree).mkdir(parents=True)
    for rel in files:
        src, dst = target.root / rel, scratch / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if originals is not None and rel in originals:
            dst.write_bytes(originals[rel])
        elif src.is_file():
            shutil.copyfile(src, dst)
    # A checkout of a release takes what a tree takes (Target.release_checkout).
    return Target(scratch, "tree" if target.release_checkout else target.kind)


def simulate(target, patches, reverse=False, originals=None, contents=None):
    """git apply (or, with `reverse`, git apply -R) `patches` in turn to a scratch copy of the
    files they change, stopping at the first that fails; [(patch, git apply's result)]. Later
    patches of the series may change what earlier ones changed, so only this order tells
    whether each applies. They are tried in one git process first (apply_at_once); where that
    does not tell each patch's result (one of several does not apply, or a hunk applies at
    an offset), they are applied one by one to a fresh copy. The target is not touched.
    `originals` ({path: bytes}) stand in for the target's files; if all patches apply,
    `contents` (a dict) gets {path: bytes} of the files after them (those that are there:
    not a new file after its patch is reversed)."""
    files = list(dict.fromkeys(rel for patch in patches for rel in target.touches(patch)))
    with tempfile.TemporaryDirectory() as tmp:
        copy = _scratch_copy(target, files, originals, Path(tmp) / "at-once")
        fault("scratch")
        results = copy.apply_patches_at_once(patches, reverse)
        if results is None:  # the copy holds what git left of it: start again from the target
            copy = _scratch_copy(target, files, originals, Path(tmp) / "in-turn")
            results = list(copy.apply_patches(patches, reverse))
        scratch = copy.root
        if contents is not None and all_apply(results):
            files = [rel for rel in files if (scratch / rel).is_file()]
            contents.update({rel: (scratch / rel).read_bytes() for rel in files})
    return results


class State:
    """The series (`patches`, default: all of it) on a target, found once."""

    def __init__(self, target, patches=None):
        self.target = target
        self.series = list(patch_files() if patches is None else patches)
        self.backup = Backup(target)
        self.saved = self.backup.states()  # {path: "original" | "patched" | "other"} or None
        # The saved originals are the files before the series while the target's files are
        # those or patched; then the recorded patches, if they are this series', say which
        # patches the target takes, else the variant that applies to the originals.
        self.from_saved = bool(self.saved) and "other" not in self.saved.values()
        recorded = self.backup.patches() if self.from_saved else None
        self.recorded = next((v for v in self.variants if patch_ids(v) == recorded), None)
        self.applied = 0  # how many of `relevant` the simulation found applied
        self.edited = []  # files changed after apply patched them (state.json says so)
        self.before = {}  # {path: bytes}: the files before `relevant`, where it found them
        self.after = {}  # and after the whole of `relevant`

    @cached_property
    def variants(self):
        """The lists of patches the target may take: the series' patches that change its
        files, then, for each compat patch that changes them too, that patch and the series.
        A compat patch makes a file of an older release read like the pinned one, so a patched
        file cannot tell which variant made it: the files before the series decide."""
        chosen = [p for p in self.series if self.target.touches(p)]
        compat = [c for c in compat_patches() if self.target.touches(c)] if chosen else []
        return [chosen] + [[c, *chosen] for c in compat]

    @cached_property
    def _variant(self):
        """(relevant, git apply's results, the files after them): the recorded patches; else
        the first variant that applies to the files before the series (the saved originals
        where they count, else the target's files); if none applies, the series alone, as a
        drifted target is reported against the series itself."""
        if self.recorded is not None:
            return self.recorded, None, None
        originals = self.backup.originals() if self.from_saved else None
        first = None
        for variant in self.variants:
            contents = {}
            results = simulate(self.target, variant, originals=originals, contents=contents)
            if all_apply(results):
                return variant, results, contents
            first = first or (variant, results, contents)
        return first

    @property
    def relevant(self):
        """The patches this target takes, in order (after the compat patch, if any)."""
        return self._variant[0]

    @cached_property
    def forward(self):
        """(results, contents after) of `relevant` applied to the target's files."""
        if not self.from_saved:  # the variant was chosen on the target's files
            return self._variant[1:]
        contents = {}
        return simulate(self.target, self.relevant, contents=contents), contents

    @cached_property
    def this_version(self):
        """Whether the saved "patched" digests are this series': the saved patches are, or
        this series applied to the saved originals gives those digests."""
        if self.recorded is not None or not self.from_saved:
            return self.recorded is not None
        _, results, contents = self._variant
        return (
            all_apply(results)
            and set(contents) == set(self.saved)
            and all(self.backup.state[rel]["patched"] == sha256(d) for rel, d in contents.items())
        )

    @property
    def other_version(self):
        """Whether the target carries another version of the series (with its saved
        originals) that this one applies to: apply replaces it."""
        if self.target.kind == "checkout" or not self.from_saved or self.this_version:
            return False
        return all_apply(self._variant[1])

    def saved_results(self):
        """git apply's results of this series on the saved originals (not this version)."""
        return self._variant[1]

    def after_saved(self):
        """{path: bytes}: this series applied to the saved originals."""
        if self._variant[2] is not None:
            return self._variant[2]
        contents = {}
        simulate(self.target, self.relevant, originals=self.backup.originals(), contents=contents)
        return contents

    @property
    def rows(self):
        """[(patch name, state, detail)] for the series' patches (and the compat patch)."""
        return self._report[0]

    @property
    def overall(self):
        """applied, not applied, interrupted or drifted."""
        return self._report[1]

    @cached_property
    def _report(self):
        target = self.target
        target.refuse_leftover()
        relevant = self.relevant
        if not relevant:
            raise ToolError(f"no patch of the series changes anything in {target}")
        patches = [p for p in relevant if p not in self.series] + self.series
        rows = {
            patch_label(p): (NOT_FOR_TARGET, "tests and docs go to source checkouts only")
            for p in patches
        }

        def report(overall):
            return [(patch_label(p), *rows[patch_label(p)]) for p in patches], overall

        saved = set((self.saved or {}).values())
        if saved == {"original", "patched"}:
            for patch in relevant:
                rows[patch_label(patch)] = (
                    INTERRUPTED,
                    (
                        "an apply or revert was interrupted: run apply to complete the series, or "
                        "revert"
                    ),
                )
            return report(INTERRUPTED)
        if saved == {"patched"} and self.this_version:
            rows.update({patch_label(p): (APPLIED, "") for p in relevant})
            return report(APPLIED)
        forward, self.after = self.forward
        if all_apply(forward):
            for patch, result in forward:
                rows[patch_label(patch)] = (NOT_APPLIED, "with offset" if offsets(result) else "")
            return report(NOT_APPLIED)
        self.edited = self.changed_since_apply()
        if self.edited:
            for patch in relevant:
                changed = [rel for rel in target.touches(patch) if rel in self.edited]
                if changed:
                    rows[patch_label(patch)] = (
                        DRIFTED,
                        f"{', '.join(changed)}: changed after apply",
                    )
            return report(DRIFTED)
        if all_apply(simulate(target, relevant[::-1], True, contents=self.before)):
            self.applied = len(relevant)
            rows.update({patch_label(p): (APPLIED, "") for p in relevant})
            return report(APPLIED)
        self.applied = self._applied_prefix()
        if self.applied:  # the series is in part (an earlier version of this tool was stopped)
            for i, patch in enumerate(relevant):
                rows[patch_label(patch)] = (APPLIED if i < self.applied else NOT_APPLIED, "")
            return report(INTERRUPTED)
        found = te_version(target)
        if older_than_supported(found) and not self.saved:
            # A release the series was never made for: not "drifted" (the word for files
            # changed since), but not applied, with why apply refuses it.
            oldest, pinned = supported_range()
            rows.update({patch_label(p): (NOT_APPLIED, "") for p in relevant})
            for patch, result in forward:
                why = "" if result.returncode == 0 else f": {failure(result, patch)}"
                rows[patch_label(patch)] = (
                    NOT_APPLIED,
                    (
                        f"TE {found} is older than the releases the series supports, {oldest} to "
                        f"{pinned}{why}"
                    ),
                )
            return report(NOT_APPLIED)
        for patch in relevant:  # where applying it stops, and why
            rows[patch_label(patch)] = (NOT_CHECKED, "an earlier patch does not apply")
        for patch, result in forward:
            rows[patch_label(patch)] = (
                (NOT_APPLIED, "") if result.returncode == 0 else (DRIFTED, failure(result, patch))
            )
        return report(DRIFTED)

    def changes(self):
        """(originals, contents): {path: bytes} of the files that applying `relevant` changes,
        before and after it, for a target that it is not applied to (or in part)."""
        originals, contents = self.before, self.after
        root = self.target.root
        current = {rel: (root / rel).read_bytes() for rel in {**originals, **contents}}
        contents = {rel: data for rel, data in contents.items() if data != current[rel]}
        return {rel: originals.get(rel, current[rel]) for rel in contents}, contents

    def changed_since_apply(self):
        """The files that apply patched (state.json, this TE release) that are now neither as
        it wrote them nor the saved originals. Found without git; where the series does not
        apply to the files either, they were changed after the apply (`edited`), not by a
        reinstall of TE (which gives the originals back, or files the series applies to)."""
        meta = self.backup.meta or {}
        if meta.get("te_version") != te_version(self.target):
            return []
        return [rel for rel, what in (self.saved or {}).items() if what == "other"]

    def _applied_prefix(self):
        """k if exactly the first k (0 < k < all) of `relevant` are applied to the target, else
        0; with `before` and `after` the files before and after the whole of `relevant`."""
        relevant = self.relevant
        for k in range(len(relevant) - 1, 0, -1):
            before, after = {}, {}
            if all_apply(simulate(self.target, relevant[:k][::-1], True, contents=before)):
                if all_apply(simulate(self.target, relevant[k:], contents=after)):
                    self.before, self.after = before, after
                    return k
        return 0

    def patched_files(self, overall):
        """{path: sha256 of its original} of the files that are as this series makes them."""
        ours = self.edited and self.backup.patches() in [patch_ids(v) for v in self.variants]
        if self.this_version or ours:  # (the files not edited after this series' apply)
            entries = self.backup.state
            return {
                rel: entries[rel]["original"] for rel, s in self.saved.items() if s == "patched"
            }
        if overall == APPLIED:
            return {rel: sha256(data) for rel, data in self.before.items()}
        return {}
