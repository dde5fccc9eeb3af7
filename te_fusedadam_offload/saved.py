"""Writing a user's TE safely, and what apply saves there.

An installed TE or a directory is changed file by file, each atomically: the new content is
written to a temporary file beside the old one, synced, given the old file's mode and renamed
over it. Before the first file is replaced, the original bytes and modes are saved in
<subtree>/.te_fusedadam_offload/ (committed by writing its state.json last), and kept until a
revert. So a run that is killed or fails at any point leaves every file either as it was or as
the series makes it, the next apply completes an interrupted apply, and revert restores the
exact original bytes and modes. state.json also records the digests of the files as the series
made them and which patches made them, so that later commands read the state from it.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

from .errors import ToolError, fault
from .series import patch_files, patch_label
from .target import BACKUP_DIR, te_version
from .upstream import sha256_of

# {"files": {path: {"mode", "original", "patched"}}, "patches": [[label, sha256]],
#  "te_version"}; written last.
STATE_FILE = "state.json"
TMP_SUFFIX = ".te-fusedadam-offload.tmp"


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
            fault("write")
            f.write(data[len(data) // 2 :])
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        fault("replace")
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _sync_dir(path.parent)


def sha256(data):
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def file_digest(path):
    """sha256 of a file, or None if there is none."""
    return sha256_of(path) if Path(path).is_file() else None


def patch_ids(patches):
    """[[label, sha256]] of patches: which patches, in which version."""
    return [[patch_label(p), sha256(Path(p).read_bytes())] for p in patches]


def modes(target, paths):
    """{path: permission bits} of the target's files."""
    return {rel: (target.root / rel).stat().st_mode & 0o7777 for rel in paths}


class Backup:
    """The original bytes and modes of the files that the series changes in a target, saved
    in <root>/<subtree>/.te_fusedadam_offload/ by apply and removed by revert."""

    def __init__(self, target):
        self.target = target
        self.dir = target.root / target.subtree / BACKUP_DIR
        self.state = self.meta = None
        # What this user may not read (PermissionError): saved by another user. Never taken
        # for stale; what needs it is refused (refuse_unreadable). A dry run's scratch copy
        # carries that of the target it copies.
        self.unreadable = getattr(target, "unreadable_backup", None)
        try:
            meta = json.loads((self.dir / STATE_FILE).read_text(encoding="utf-8"))
            state = meta["files"]
            found = [self.original(rel, state) for rel in state]
            # state.json is written last: where an original cannot be read, it counts.
            if self.unreadable or all(data is not None for data in found):
                self.state, self.meta = state, meta
        except PermissionError as exc:
            self.unreadable = exc
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, or not complete: no file was replaced after it

    def original(self, rel, state=None):
        """The saved original bytes of `rel`, or None if they are not (all) there."""
        state = state or self.state
        try:
            data = (self.dir / "original" / rel).read_bytes()
        except PermissionError as exc:
            self.unreadable = self.unreadable or exc
            return None
        except OSError:
            return None
        return data if sha256(data) == state[rel]["original"] else None

    def refuse_unreadable(self, action="this command"):
        """Raise ToolError if some of what apply saved cannot be read by this user: `action`
        needs it (or would change it) and changes nothing."""
        if self.unreadable is not None:
            exc = self.unreadable
            raise ToolError(
                f"cannot read {exc.filename or self.dir}: {exc.strerror or exc} (apply saved it "
                f"as another user); {action} needs it: run {action} as that user, or as one who "
                f"can read {self.dir}; nothing was changed"
            )

    def originals(self):
        """{path: saved original bytes}."""
        self.refuse_unreadable()
        return {rel: self.original(rel) for rel in self.state}

    def states(self):
        """{path: "original" | "patched" | "other"} of the saved files, or None if none."""
        if self.state is None:
            return None
        found = {}
        for rel, entry in self.state.items():
            digest = file_digest(self.target.root / rel)
            found[rel] = {entry["original"]: "original", entry["patched"]: "patched"}.get(
                digest, "other"
            )
        return found

    def patches(self):
        """patch_ids() of the patches that made the saved "patched" digests, or None where
        state.json does not say (written by an earlier version of this tool)."""
        return (self.meta or {}).get("patches")

    def save(self, originals, file_modes, contents, patches):
        """Save the originals; the state file, written last, makes them count."""
        for rel, data in originals.items():
            path = self.dir / "original" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, data, file_modes[rel] & 0o666)  # readable by whoever reads the file
        state = {
            rel: {
                "mode": file_modes[rel],
                "original": sha256(originals[rel]),
                "patched": sha256(contents[rel]),
            }
            for rel in originals
        }
        meta = {"files": state, "te_version": te_version(self.target)}
        meta["patches"] = patch_ids(patches)
        text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
        write_file(self.dir / STATE_FILE, text.encode("utf-8"), 0o644)
        self.state, self.meta = state, meta

    def remove(self):
        """Forget the originals: the state file first, then the rest."""
        self.refuse_unreadable()
        fault("unlink")
        (self.dir / STATE_FILE).unlink(missing_ok=True)
        _sync_dir(self.dir)
        shutil.rmtree(self.dir)
        self.state = None


def remove_stale_files(target):
    """Temporary files that a killed run left, and saved originals that no state file counts."""
    dirs = {(target.root / rel).parent for p in patch_files() for rel in target.touches(p)}
    backup = Backup(target)
    dirs.add(backup.dir)
    for directory in dirs:
        for stale in directory.glob(f".*{TMP_SUFFIX}"):
            try:
                stale.unlink()
            except PermissionError:
                pass  # another user's, in a directory that this one cannot write: harmless
    if backup.state is None and backup.unreadable is None and backup.dir.is_dir():
        shutil.rmtree(backup.dir)


def write_files(target, contents, file_modes, action):
    """Write `contents` ({path: bytes}) into the target; if that fails, say what it left."""
    before = {rel: file_digest(target.root / rel) for rel in contents}
    for rel, data in contents.items():
        try:
            write_file(target.root / rel, data, file_modes[rel])
        except OSError as exc:
            raise ToolError(
                f"{action} stopped: {exc.strerror or exc} while writing {target.root / rel}; "
                + checked_state(target, before, contents)
            ) from exc


def replace_files(backup, originals, contents, patches):
    """Save the `originals` ({path: bytes}) in `backup`, then write `contents` (what `patches`
    make of them) over the target's files with their modes: the commit protocol of apply. If
    saving fails, nothing was replaced and nothing is kept; if writing fails before any file
    was replaced, the saved originals are forgotten; either way ToolError says what the files
    are, read back."""
    target = backup.target
    file_modes = modes(target, contents)
    try:
        backup.save(originals, file_modes, contents, patches)
    except OSError as exc:
        shutil.rmtree(backup.dir, ignore_errors=True)  # not committed: no file was replaced
        before = {rel: sha256(data) for rel, data in originals.items()}
        raise ToolError(
            f"apply stopped: {exc.strerror or exc} while saving the originals in {backup.dir}; "
            + checked_state(target, before, contents)
        ) from exc
    try:
        write_files(target, contents, file_modes, "apply")
    except ToolError:
        if set(backup.states().values()) == {"original"}:  # no file replaced: forget them
            try:
                backup.remove()
            except OSError:
                pass
        raise


def checked_state(target, before, contents):
    """What the files are now, read back after a failure: as before, or written."""
    now = {}
    for rel, data in contents.items():
        digest = file_digest(target.root / rel)
        if digest == before[rel]:
            now[rel] = "as before"
        else:
            now[rel] = "written" if digest == sha256(data) else "changed otherwise"
    if set(now.values()) == {"as before"}:
        return "nothing was changed (checked)"
    listing = ", ".join(f"{rel}: {state}" for rel, state in sorted(now.items()))
    return f"checked: {listing}; run apply again to complete the series, or revert to undo it"
