"""Apply, check, revert and report the series on a TE tree: installed, a checkout, a directory.

An installed TE or a directory is changed file by file, each atomically: the new content is
written to a temporary file beside the old one, synced, given the old file's mode and renamed
over it. Before the first file is replaced, the original bytes and modes are saved in
<subtree>/.te_fusedadam_offload/ (committed by writing its state.json last), and kept until a
revert. So a run that is killed or fails at any point leaves every file either as it was or as
the series makes it, the next apply completes an interrupted apply, and revert restores the
exact original bytes and modes.
"""

import difflib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import NeedsError, NoTargetError, ToolError
from .patching import all_apply, apply_all, apply_in_order, failure, git, git_am, offsets, touched
from .series import compat_patches, load_checksums, patch_files, patch_label
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

    def __init__(self, root, kind, python=None):
        self.root = Path(root).resolve()
        self.kind = kind
        self.python = python  # the interpreter whose installed TE this is (kind "installed")
        self.subtree = load_pin()["subtree"]
        if not (self.root / self.subtree).is_dir():
            hint = ""
            if self.root.name == self.subtree:
                hint = f"; pass the directory that holds it, {self.root.parent}"
            raise NoTargetError(f"{self.root} holds no {self.subtree}/ directory{hint}")
        package = self.root / self.subtree
        # What `pip uninstall` leaves of a patched TE: the saved originals, which pip does
        # not know about, and nothing else of TE.
        self.leftover = not (package / "__init__.py").exists() and (package / BACKUP_DIR).is_dir()

    def __str__(self):
        return f"{self.kind} TE at {self.root}"

    def refuse_leftover(self):
        """Raise NoTargetError if TE was uninstalled from here and only the saved originals
        are left."""
        if self.leftover:
            raise NoTargetError(
                f"no TE at {self.root}: {self.subtree}/ holds only {BACKUP_DIR}/, the original "
                "files that apply saved, left behind when TE was uninstalled (pip removes only "
                "the files it installed); 'revert' removes it, or: rm -r "
                f"{self.root / self.subtree / BACKUP_DIR}"
            )

    @property
    def include(self):
        """The paths of a patch that this target holds (git apply --include patterns)."""
        return [] if self.kind == "checkout" else [f"{self.subtree}/*"]

    def touches(self, patch):
        """The files of this target that a patch changes."""
        files = touched(patch)
        return files if self.kind == "checkout" else [f for f in files if self.holds(f)]

    def holds(self, rel):
        """Whether the series' file `rel` is one of this kind of target."""
        return self.kind == "checkout" or rel.startswith(self.subtree + "/")

    def apply_patches(self, patches, reverse=False):
        """apply_in_order of `patches` to this target's files (see there)."""
        return apply_in_order(self.root, patches, self.include, reverse)

    def patch(self, patches):
        """git apply the patches that change this target's files, in turn, in place: for
        scratch copies that the tool makes itself (materialize), not for a user's TE. Returns
        how many applied; raises ToolError at the first that does not."""
        return apply_all(self.root, [p for p in patches if self.touches(p)], self.include)


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


def version_key(version):
    """(major, minor, patch) of a release string such as '2.16.1' or '2.20.0.dev0'."""
    numbers = [int(n) for n in re.findall(r"\d+", version)[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def supported_range():
    """(oldest, pinned): the releases from `oldest` on are supported; `pinned` is the one the
    series is made and tested for."""
    pin = load_pin()
    return pin.get("supported", {}).get("oldest", pin["version"]), pin["version"]


def older_than_supported(version):
    """Whether a TE version is older than the oldest release the series supports."""
    return version is not None and version_key(version) < version_key(supported_range()[0])


# Where the TE that a Python imports lives; run from "/", so that the current directory
# (a checkout with transformer_engine/ in it) does not decide it. Nothing is imported.
_FIND_TE = (
    "import importlib.util, json; s = importlib.util.find_spec('transformer_engine'); "
    "print(json.dumps(list(s.submodule_search_locations or []) if s else []))"
)


def _installed_location(python):
    """The directory holding the transformer_engine/ that `python` imports, or None."""
    try:
        result = subprocess.run(
            [python, "-c", _FIND_TE], cwd="/", capture_output=True, text=True, check=False
        )
    except OSError as exc:
        raise NeedsError(f"cannot run the Python {python}: {exc.strerror or exc}") from exc
    if result.returncode != 0:
        raise NeedsError(f"the Python {python} failed: {result.stderr.strip()[-500:]}")
    locations = json.loads(result.stdout.strip().splitlines()[-1])
    return Path(locations[0]).parent if locations else None


def find_target(path=None, installed=False, python=None):
    """The target named by a path, or the TE that this Python (or `python`) imports."""
    if installed or python is not None or path is None:
        python = python or sys.executable
        root = _installed_location(python)
        if root is None:
            where = "this Python environment" if python == sys.executable else python
            raise NoTargetError(
                f"transformer_engine is not installed in {where} "
                "(pass the path of a TE tree instead)"
            )
        return Target(root, "installed", python)
    root = Path(path)
    if not root.exists():
        raise NoTargetError(f"{root} does not exist")
    if not root.is_dir():
        raise NoTargetError(f"{root} is not a directory")
    kind = "checkout" if (root / ".git").exists() else "tree"
    return Target(root, kind)


def relevant_patches(target, patches=None, originals=None):
    """The patches of the series (or of `patches`) that change files this target holds.

    Without `patches`, on an older release whose context lines the series needs a compat
    patch for (compat/), that patch comes first. Which variant (the series alone, or after a
    compat patch) is decided by the files before the series: `originals` (see simulate), else
    the originals that apply saved in the target (while its files are those or patched), else
    the target's files: the first variant that applies to them. A compat patch makes a file of
    an older release read like a newer one, so a patched file cannot tell which variant made
    it; a compat patch is only ever applied by apply, which saves the originals. If no variant
    applies, the series alone (a drifted target is reported against the series itself)."""
    chosen = [p for p in (patch_files() if patches is None else patches) if target.touches(p)]
    if patches is not None or not chosen:
        return chosen
    compat = [c for c in compat_patches() if target.touches(c)]
    if not compat:
        return chosen
    if originals is None:
        backup = _Backup(target)
        saved = backup.states()
        if saved and "other" not in saved.values():
            originals = {rel: backup.original(rel) for rel in saved}
    for variant in [chosen] + [[c, *chosen] for c in compat]:
        if all_apply(simulate(target, variant, originals=originals)):
            return variant
    return chosen


def simulate(target, patches, *reverse, originals=None, contents=None):
    """git apply (or, with "-R", reverse) `patches` in turn to a scratch copy of the files they
    change, stopping at the first that fails; [(patch, git apply's result)]. Later patches of
    the series may change what earlier ones changed, so only this order tells whether each
    applies. The target is not touched. `originals` ({path: bytes}) stand in for the target's
    files; if all patches apply, `contents` (a dict) gets {path: bytes} of the files after
    them."""
    files = list(dict.fromkeys(rel for patch in patches for rel in target.touches(patch)))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "target"
        (scratch / target.subtree).mkdir(parents=True)
        for rel in files:
            src, dst = target.root / rel, scratch / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if originals is not None and rel in originals:
                dst.write_bytes(originals[rel])
            elif src.is_file():
                shutil.copyfile(src, dst)
        results = list(Target(scratch, target.kind).apply_patches(patches, bool(reverse)))
        if contents is not None and all_apply(results):
            contents.update({rel: (scratch / rel).read_bytes() for rel in files})
    return results


def status(target):
    """[(patch name, state, detail)] and the overall state."""
    target.refuse_leftover()
    relevant = relevant_patches(target)
    if not relevant:
        raise ToolError(f"no patch of the series changes anything in {target}")
    # The series' patches, after the compat patch that this release needs, if any.
    patches = [p for p in relevant if p not in patch_files()] + patch_files()
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
    if all_apply(forward):
        overall = NOT_APPLIED
        for patch, result in forward:
            rows[patch_label(patch)] = (NOT_APPLIED, "with offset" if offsets(result) else "")
    elif all_apply(simulate(target, relevant[::-1], "-R")):
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
                    else (DRIFTED, failure(result, patch))
                )
    return [(patch_label(p), *rows[patch_label(p)]) for p in patches], overall


def _applied_prefix(target, patches):
    """k if exactly the first k (0 < k < all) of `patches` are applied to the target, else 0."""
    for k in range(len(patches) - 1, 0, -1):
        if all_apply(simulate(target, patches[:k][::-1], "-R")) and all_apply(
            simulate(target, patches[k:])
        ):
            return k
    return 0


def file_report(target, overall=None):
    """[(path, what it is)] for the upstream files the series changes: compared byte for byte
    with the pinned release's file and with that file patched, and, where it is neither (as
    on another TE version), by what the series does to it (`overall`, from status())."""
    report = []
    if target.leftover:
        return [(rel, "missing (TE was uninstalled)") for rel in sorted(load_checksums())]
    pinned, found = load_pin()["version"], te_version(target)
    other = found if found and found != pinned else None
    saved = _Backup(target).states() or {}
    for rel, (before, after) in sorted(load_checksums().items()):
        path = target.root / rel
        if not path.is_file():
            report.append((rel, "missing"))
            continue
        digest = sha256_of(path)
        if digest == before:
            report.append((rel, f"as released in TE {pinned}"))
        elif digest == after:
            report.append((rel, f"TE {pinned}'s, patched by this series"))
        elif saved.get(rel) == "patched" and other_version(target):
            report.append((rel, "patched by another version of this series; apply replaces it"))
        elif overall == APPLIED:
            report.append((rel, f"TE {other or 'of another version'}'s, patched by this series"))
        elif overall == NOT_APPLIED:
            report.append((rel, f"as released in TE {other}" if other else "not patched"))
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


def notes(target, overall):
    """What the user should know beyond the state: TE reinstalled or upgraded over an apply."""
    backup = _Backup(target)
    saved = backup.states()
    if overall != NOT_APPLIED or not saved or "patched" in saved.values():
        return []
    then = (backup.meta or {}).get("te_version")
    now = te_version(target)
    change = f" (TE {then} then, TE {now} now)" if then and now and then != now else ""
    return [
        f"the series was applied here and is not now{change}: TE was reinstalled or upgraded "
        "since (which undoes it), or an apply was stopped before it changed a file. Run apply "
        "again; it is idempotent: run it after every install or upgrade of TE"
    ]


class _Backup:
    """The original bytes and modes of the files that the series changes in a target, saved
    in <root>/<subtree>/.te_fusedadam_offload/ by apply and removed by revert."""

    def __init__(self, target):
        self.target = target
        self.dir = target.root / target.subtree / BACKUP_DIR
        self.state = self.meta = None
        try:
            meta = json.loads((self.dir / STATE_FILE).read_text(encoding="utf-8"))
            state = meta["files"]
            if all(self.original(rel, state) is not None for rel in state):
                self.state, self.meta = state, meta
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
        meta = {"files": state, "te_version": te_version(self.target)}
        text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
        write_file(self.dir / STATE_FILE, text.encode("utf-8"), 0o644)
        self.state, self.meta = state, meta

    def remove(self):
        """Forget the originals: the state file first, then the rest."""
        _fault("unlink")
        (self.dir / STATE_FILE).unlink(missing_ok=True)
        _sync_dir(self.dir)
        shutil.rmtree(self.dir)
        self.state = None


def _remove_stale_files(target):
    """Temporary files that a killed run left, and saved originals that no state file counts."""
    dirs = {(target.root / rel).parent for p in patch_files() for rel in target.touches(p)}
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
    target.refuse_leftover()
    _remove_stale_files(target)
    backup = _Backup(target)
    saved = backup.states()
    if saved and set(saved.values()) == {"original"}:
        # Saved, but no file is patched: TE was reinstalled since, or an apply stopped before
        # it replaced a file. Nothing to complete: start afresh.
        backup.remove()
        saved = None
    if saved and "other" not in saved.values():
        results, contents, other = _against_saved(target, backup, saved)
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
    found = te_version(target)
    if older_than_supported(found):
        raise ToolError(_drift_message(target, rows, "apply"))
    # Not applied, or the first patches only: the files before and after the whole series.
    relevant = relevant_patches(target)
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
    if saved:
        done += " (TE was reinstalled or upgraded since the last apply: saved its files afresh)"
    return done + _version_note(target)


def _against_saved(target, backup, saved):
    """This version of the series applied to the saved originals: (git apply's results, the
    files after it, whether the target carries another version of the series)."""
    originals = {rel: backup.original(rel) for rel in saved}
    relevant = relevant_patches(target, originals=originals)
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
    results, _, other = _against_saved(target, backup, saved)
    return other and all_apply(results)


def _replace_other_version(target, results):
    """The target carries another version of the series (applied by another release of this
    tool, whose saved originals are there): put the originals back and apply this version,
    if it applies to them; else change nothing."""
    if not all_apply(results):
        patch, result = results[-1]
        raise ToolError(
            f"{target.subtree}/ carries another version of this series, and this version does "
            f"not apply to the original files saved with it ({patch_label(patch)}: "
            f"{failure(result, patch)}); nothing was changed. 'revert' restores the originals."
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
    git_am(target.root, patches)
    return f"applied {len(patches)} patches as commits with git am"


def revert(target):
    """Take the series out again; a no-op if it is not applied. The saved originals are
    written back with their modes; without them (a TE patched otherwise), the series is
    reversed."""
    patches = patch_files()
    if target.kind == "checkout":
        return _revert_checkout(target, patches)
    if target.leftover:
        shutil.rmtree(target.root / target.subtree / BACKUP_DIR)
        if not any((target.root / target.subtree).iterdir()):
            (target.root / target.subtree).rmdir()
        return (
            "TE is not installed here; removed the original files that apply had saved, left "
            f"behind in {target.subtree}/{BACKUP_DIR}/ when TE was uninstalled"
        )
    _remove_stale_files(target)
    backup = _Backup(target)
    saved = backup.states()
    if saved and "other" not in saved.values():
        saved_originals = {rel: backup.original(rel) for rel in saved}
        relevant = relevant_patches(target, originals=saved_originals)
        todo = [rel for rel, state in saved.items() if state == "patched"]
        originals = {rel: saved_originals[rel] for rel in todo}
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
        if saved:  # of a TE that was reinstalled or upgraded since: they restore nothing now
            shutil.rmtree(backup.dir)
            return (
                "not applied (TE was reinstalled or upgraded since the last apply); removed the "
                "original files saved then"
            )
        return "not applied; nothing to do"
    if overall == DRIFTED:
        raise ToolError(_drift_message(target, rows, "revert"))
    # Applied, or the first patches only, without saved originals: reverse what is applied.
    relevant = relevant_patches(target)
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
    if target.kind == "checkout":
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
    lines = [f"cannot {action}: {lead}"]
    lines += [
        f"  {name}: {state}" + (f" ({detail})" if detail else "") for name, state, detail in rows
    ]
    lines.append(f"What to do: {advice}.")
    return "\n".join(lines)


def dry_run(target):
    """(what apply would say, the unified diff of what it would change): apply runs on a
    scratch copy of the files it reads; the target is not touched."""
    if target.kind == "checkout":
        rows, overall = status(target)
        if overall == APPLIED:
            return "already applied; nothing to do", ""
        if overall == DRIFTED:
            raise ToolError(_drift_message(target, rows, "apply"))
        contents = {}
        simulate(target, patch_files(), contents=contents)
        return f"would apply {len(patch_files())} patches as commits with git am", _diff(
            target.root, contents
        )
    target.refuse_leftover()
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
        if (package / BACKUP_DIR).is_dir():
            shutil.copytree(package / BACKUP_DIR, scratch / target.subtree / BACKUP_DIR)
        copy = Target(scratch, target.kind, target.python)
        try:
            message = apply(copy).replace(str(copy.root), str(target.root))
        except ToolError as exc:
            raise type(exc)(str(exc).replace(str(copy.root), str(target.root))) from None
        contents = {
            rel: (scratch / rel).read_bytes() for rel in changed if (scratch / rel).is_file()
        }
        return message, _diff(target.root, contents)


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
