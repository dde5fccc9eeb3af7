"""What the series is on a target, read once per command: the one answer to "is it applied?".

A State reads, once, the target's files that the series changes (their bytes and modes), what
apply saved there (saved.py) and the TE release; nothing else of the target is read after
(but, for a git checkout, what git says of its commits and changes, when a plan asks). From
those bytes it finds each answer when first asked for, and once: from the digests that apply
recorded in state.json where they are there and were made by this series (the patches it
records, or the series applied to the saved originals, give them); only without them by
applying the patches, in series order, to a scratch copy of the bytes (forward: not applied;
backward: applied). The answers: the rows and overall state that status prints, which patches
the target takes (the compat patch its release needs first, if any), the files before and after
the series that apply and revert write, and whether another version of the series is there.
"""

from functools import cached_property

from .errors import ToolError
from .patching import all_apply, failure, git, offsets, simulate
from .saved import Backup, patch_ids, sha256
from .series import compat_patches, load_checksums, patch_files, patch_label
from .target import older_than_supported, supported_range, te_version

APPLIED, NOT_APPLIED, DRIFTED = "applied", "not applied", "drifted"
INTERRUPTED = "interrupted"
NOT_FOR_TARGET = "not for this target"
NOT_CHECKED = "not checked"


def _read(target, touched, action):
    """(files, modes, what apply saved): all that a command reads of a target's files. `files`
    ({path: bytes, or None where there is none}) and `modes` are those that the patches change
    (`touched`: {patch: [path]}) and that apply's state.json names."""
    backup = Backup(target, action)
    names = {rel for paths in touched.values() for rel in paths}
    files, modes = {}, {}
    for rel in sorted(names | set(load_checksums()) | set(backup.state or ())):
        path = target.root / rel
        files[rel] = path.read_bytes() if path.is_file() else None
        if files[rel] is not None:
            modes[rel] = path.stat().st_mode & 0o7777
    return files, modes, backup


class State:
    """The series (`patches`, default: all of it) on a target, read once for `action` (the
    command, which a refusal names); `found`: what _read returns, where it is known (the files
    as a plan will have written them)."""

    def __init__(self, target, patches=None, action="this command", found=None):
        self.target, self.action = target, action
        self.series = list(patch_files() if patches is None else patches)
        # What the target is, asked of it once: the files that each patch changes there, the
        # paths that git apply takes, whether an installed TE's files are a git checkout's,
        # its TE release.
        patches = [*patch_files(), *self.series, *compat_patches()]
        self.touched = {patch: target.touches(patch) for patch in patches}
        self.include, self.source_checkout = target.include, target.source_checkout
        self.te_version = te_version(target)
        self.files, self.modes, self.backup = found or _read(target, self.touched, action)
        self.saved = self.backup.states(self.files)  # {path: "original" | "patched" | "other"}
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

    def forgetting_saved(self, written=None, modes=None):
        """The State of this target once what apply saved is removed (and `written`, {path:
        bytes}, written with `modes`): what a new read would find, from these bytes."""
        found = (
            {**self.files, **(written or {})},
            {**self.modes, **(modes or {})},
            Backup(self.target, self.action, read=False),
        )
        return State(self.target, self.series, self.action, found)

    def _simulate(self, patches, reverse=False, originals=None):
        """patching.simulate of `patches` on the target's files (or their `originals`):
        (results, {path: bytes} after them, empty unless all apply)."""
        names = dict.fromkeys(rel for patch in patches for rel in self.touched[patch])
        files = {rel: (originals or {}).get(rel, self.files.get(rel)) for rel in names}
        results, contents = simulate(files, patches, self.include, reverse)
        return results, contents or {}

    @cached_property
    def variants(self):
        """The lists of patches the target may take: the series' patches that change its
        files, then, for each compat patch that changes them too, that patch and the series.
        A compat patch makes a file of an older release read like the pinned one, so a patched
        file cannot tell which variant made it: the files before the series decide."""
        chosen = [p for p in self.series if self.touched[p]]
        compat = [c for c in compat_patches() if self.touched[c]] if chosen else []
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
            results, contents = self._simulate(variant, originals=originals)
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
        return self._simulate(self.relevant)

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
        return self._simulate(self.relevant, originals=self.backup.originals())[1]

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
        if target.leftover:
            target.refuse_leftover()
        relevant = self.relevant
        if not relevant:
            raise ToolError(f"no patch of the series changes anything in {target}")
        patches = [p for p in relevant if p not in self.series] + self.series
        rows = {
            patch_label(p): (NOT_FOR_TARGET, "tests and docs go to source checkouts only")
            for p in patches
        }

        def report(overall, states=None):
            rows.update({patch_label(p): (state, "") for p, state in (states or {}).items()})
            return [(patch_label(p), *rows[patch_label(p)]) for p in patches], overall

        saved = set((self.saved or {}).values())
        if saved == {"original", "patched"}:
            why = "an apply or revert was interrupted: run apply to complete the series, or revert"
            rows.update({patch_label(p): (INTERRUPTED, why) for p in relevant})
            return report(INTERRUPTED)
        if saved == {"patched"} and self.this_version:
            return report(APPLIED, dict.fromkeys(relevant, APPLIED))
        forward, self.after = self.forward
        if all_apply(forward):
            for patch, result in forward:
                rows[patch_label(patch)] = (NOT_APPLIED, "with offset" if offsets(result) else "")
            return report(NOT_APPLIED)
        self.edited = self.changed_since_apply()
        if self.edited:
            for patch in relevant:
                changed = [rel for rel in self.touched[patch] if rel in self.edited]
                if changed:
                    rows[patch_label(patch)] = (
                        DRIFTED,
                        f"{', '.join(changed)}: changed after apply",
                    )
            return report(DRIFTED)
        results, before = self._simulate(relevant[::-1], reverse=True)
        if all_apply(results):
            self.before, self.applied = before, len(relevant)
            return report(APPLIED, dict.fromkeys(relevant, APPLIED))
        self.applied = self._applied_prefix()
        if self.applied:  # the series is in part (an earlier version of this tool was stopped)
            states = {
                p: APPLIED if i < self.applied else NOT_APPLIED for i, p in enumerate(relevant)
            }
            return report(INTERRUPTED, states)
        found = self.te_version
        if older_than_supported(found) and not self.saved:
            # A release the series was never made for: not "drifted" (the word for files
            # changed since), but not applied, with why apply refuses it.
            oldest, pinned = supported_range()
            rows.update({patch_label(p): (NOT_APPLIED, "") for p in relevant})
            for patch, result in forward:
                why = "" if result.returncode == 0 else f": {failure(result, patch)}"
                older = f"TE {found} is older than the releases the series supports"
                rows[patch_label(patch)] = (NOT_APPLIED, f"{older}, {oldest} to {pinned}{why}")
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
        contents = {rel: data for rel, data in self.after.items() if data != self.files.get(rel)}
        return {rel: self.before.get(rel, self.files.get(rel)) for rel in contents}, contents

    def changed_since_apply(self):
        """The files that apply patched (state.json, this TE release) that are now neither as
        it wrote them nor the saved originals. Found without git; where the series does not
        apply to the files either, they were changed after the apply (`edited`), not by a
        reinstall of TE (which gives the originals back, or files the series applies to)."""
        if (self.backup.meta or {}).get("te_version") != self.te_version:
            return []
        return [rel for rel, what in (self.saved or {}).items() if what == "other"]

    def _applied_prefix(self):
        """k if exactly the first k (0 < k < all) of `relevant` are applied to the target, else
        0; with `before` and `after` the files before and after the whole of `relevant`."""
        relevant = self.relevant
        for k in range(len(relevant) - 1, 0, -1):
            results, before = self._simulate(relevant[:k][::-1], reverse=True)
            if all_apply(results):
                results, after = self._simulate(relevant[k:])
                if all_apply(results):
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

    # A git checkout: what git says, read when a plan asks (plan.py).

    def uncommitted(self, *paths):
        """The tracked files with uncommitted changes (git status), among `paths` if given
        (then as git reset --keep sees them: submodules aside)."""
        args = ["status", "--porcelain", "--untracked-files=no"]
        if paths:
            args += ["--ignore-submodules=all", "--", *paths]
        return [line[3:] for line in git(args, self.target.root).stdout.splitlines()]

    def newest_commits(self, count):
        """The titles of the newest `count` commits, oldest first."""
        log = git(["log", "--format=%s", f"-{count}"], self.target.root).stdout.splitlines()
        return log[::-1]
