"""What apply saved in a target, as a command reads it, and the one rule for what this user
cannot read there.

Before it replaces a file of an installed TE or a directory, apply saves the original bytes and
modes of the files it changes in <subtree>/.te_fusedadam_offload/ (actions.py writes them:
the originals first, then state.json, which makes them count), and keeps them until a revert.
state.json also records the digests of the files as the series made them and which patches
made them, so that a later command reads the state from it:

    {"files": {path: {"mode", "original", "patched"}}, "patches": [[label, sha256]],
     "te_version"}
"""

import hashlib
import json
from pathlib import Path

from .errors import ToolError
from .series import patch_label
from .target import BACKUP_DIR

STATE_FILE = "state.json"
TMP_SUFFIX = ".te-fusedadam-offload.tmp"  # a file being written beside the one it replaces


def sha256(data):
    """Hex sha256 of bytes (or None for None: no file)."""
    return None if data is None else hashlib.sha256(data).hexdigest()


def patch_ids(patches):
    """[[label, sha256]] of patches: which patches, in which version."""
    return [[patch_label(p), sha256(Path(p).read_bytes())] for p in patches]


class Backup:
    """What apply saved in a target, read once (`read`: else as where nothing is saved): `state`
    and `meta` (state.json's "files" and all of it) where state.json and every original it
    lists are there and whole, else None (a run stopped before it wrote state.json: they do
    not count, and `stale` says whether they are left to remove). What this user may not read
    (apply saved it as another user) is `unreadable`: never taken for stale, and needed by a
    command that reads, writes over or removes what was saved, which refuses
    (refuse_unreadable)."""

    def __init__(self, target, action="this command", read=True):
        self.dir = target.root / target.subtree / BACKUP_DIR
        self.action = action  # the command, for its refusal
        self.state = self.meta = self.unreadable = None
        self._originals = {}
        if not read:
            self.stale = False
            return
        try:
            meta = json.loads((self.dir / STATE_FILE).read_text(encoding="utf-8"))
            found = {
                rel: self._read(rel, entry["original"]) for rel, entry in meta["files"].items()
            }
            # state.json is written last: where an original cannot be read, it counts.
            if self.unreadable or all(data is not None for data in found.values()):
                self.state, self.meta, self._originals = meta["files"], meta, found
        except PermissionError as exc:
            self.unreadable = exc
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # none, or not complete: no file was replaced after it
        self.stale = self.state is None and self.unreadable is None and self.dir.is_dir()

    def _read(self, rel, digest):
        """The saved original bytes of `rel` if they are there and have `digest`, else None."""
        try:
            data = (self.dir / "original" / rel).read_bytes()
        except PermissionError as exc:
            self.unreadable = self.unreadable or exc
            return None
        except OSError:
            return None
        return data if sha256(data) == digest else None

    def refuse_unreadable(self, action=None):
        """The rule for what apply saved that this user cannot read: raise ToolError if some of
        it is, as `action` (default: the command's) needs it, and changes nothing."""
        if self.unreadable is not None:
            exc, action = self.unreadable, action or self.action
            raise ToolError(
                f"cannot read {exc.filename or self.dir}: {exc.strerror or exc} (apply saved it "
                f"as another user); {action} needs it: run {action} as that user, or as one who "
                f"can read {self.dir}; nothing was changed"
            )

    def originals(self):
        """{path: saved original bytes}; refused where some cannot be read."""
        self.refuse_unreadable()
        return dict(self._originals)

    def mode(self, rel):
        """The saved mode of `rel`."""
        return self.state[rel]["mode"]

    def states(self, files):
        """{path: "original" | "patched" | "other"} of the saved files, by the digests of
        `files` ({path: bytes or None}, as the target has them), or None if none are saved."""
        if self.state is None:
            return None
        return {
            rel: {entry["original"]: "original", entry["patched"]: "patched"}.get(
                sha256(files.get(rel)), "other"
            )
            for rel, entry in self.state.items()
        }

    def patches(self):
        """patch_ids() of the patches that made the saved "patched" digests, or None where
        state.json does not say (written by an earlier version of this tool)."""
        return (self.meta or {}).get("patches")
