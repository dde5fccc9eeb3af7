"""apply and revert: the target read once (state.py), the plan decided from it (plan.py), and
carried out here, the only code that changes a target, under its lock.

An installed TE or a directory is changed file by file, each atomically: the new content is
written to a temporary file beside the old one, synced, given the old file's mode and renamed
over it. Before the first file is replaced, apply saves the original bytes and modes in
<subtree>/.te_fusedadam_offload/ and then state.json, which makes them count (saved.py), and
keeps them until a revert, which removes state.json first. So a run that is killed or fails at
any point leaves every file either as it was or as the series makes it, the next apply
completes an interrupted apply, and revert restores the exact original bytes and modes; a run
that fails says what the files are, read back. A TE git checkout gets the series as commits (git
am) and loses them with git reset."""

import contextlib
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from .errors import ToolError, fault
from .patching import git, git_am
from .plan import Drop, Forget, GitAm, GitReset, Save, Tidy, Write, apply_plan, revert_plan
from .saved import STATE_FILE, TMP_SUFFIX, patch_ids, sha256
from .state import State
from .target import BACKUP_DIR
from .upstream import sha256_of


def apply(target, patches=None):
    """Apply the series (or `patches`, a prefix of it) to `target`; what it did, in a line."""
    return carry_out(apply_plan(State(target, patches, "apply")))


def revert(target, discard_edits=False):
    """Take the series out of `target`; what it did, in a line."""
    return carry_out(revert_plan(State(target, action="revert"), discard_edits))


def carry_out(plan):
    """Carry out the steps of `plan` in order; raise its refusal, if any, else return its
    message."""
    for step in plan.steps:
        _STEPS[type(step)](plan.target, step)
    if plan.refusal is not None:
        raise plan.refusal
    return plan.message


@contextlib.contextmanager
def locked(target, exclusive, command, waiting=None):
    """Hold the lock of `target` for the block: exclusive for apply and revert, shared for the
    reading commands. It is flock(2) on transformer_engine/ itself, opened read-only: it needs
    no write access, leaves no file behind, is seen by every process on the machine whatever
    venv its tool runs from, and goes with the process (a killed run holds it no longer). Waits
    for a run that holds it, saying so on standard error once; `waiting`, if given, is called
    first (so that a Ctrl-C while it waits is told from one before it took a free lock)."""
    directory = target.root / target.subtree
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        fault("lock")
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            print(
                f"te-fusedadam-offload {command}: waiting for another te-fusedadam-offload run "
                f"on {directory} to finish",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, kind)
        yield
    finally:
        os.close(fd)  # releases the lock


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


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _saved_dir(target):
    return target.root / target.subtree / BACKUP_DIR


def _tidy(target, step):
    """Temporary files that a killed run left, and saved originals that no state file counts."""
    for directory in step.dirs:
        for stale in directory.glob(f".*{TMP_SUFFIX}"):
            try:
                stale.unlink()
            except PermissionError:
                pass  # another user's, in a directory that this one cannot write: harmless
    if step.saved:
        shutil.rmtree(_saved_dir(target))


def _write(target, step):
    """Write the files of `step`; if that fails, say what it left, read back."""
    for rel, data in step.contents.items():
        try:
            write_file(target.root / rel, data, step.modes[rel])
        except OSError as exc:
            raise ToolError(
                f"{step.action} stopped: {exc.strerror or exc} while writing {target.root / rel}; "
                + _checked_state(target, step.before, step.contents)
            ) from exc


def _save(target, step):
    """apply's commit protocol: the originals saved, state.json (last) makes them count, then
    the files written. If saving fails, nothing was replaced and nothing is kept; if writing
    fails before any file was replaced, the saved originals are forgotten; either way
    ToolError says what the files are, read back."""
    directory, originals, write = _saved_dir(target), step.originals, step.write
    try:
        for rel, data in originals.items():
            path = directory / "original" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, data, write.modes[rel] & 0o666)  # readable by whoever reads the file
        files = {
            rel: {
                "mode": write.modes[rel],
                "original": sha256(data),
                "patched": sha256(write.contents[rel]),
            }
            for rel, data in originals.items()
        }
        meta = {"files": files, "te_version": step.te_version, "patches": patch_ids(step.patches)}
        text = json.dumps(meta, indent=1, sort_keys=True) + "\n"
        write_file(directory / STATE_FILE, text.encode("utf-8"), 0o644)
    except OSError as exc:
        shutil.rmtree(directory, ignore_errors=True)  # not committed: no file was replaced
        before = {rel: sha256(data) for rel, data in originals.items()}
        raise ToolError(
            f"apply stopped: {exc.strerror or exc} while saving the originals in {directory}; "
            + _checked_state(target, before, write.contents)
        ) from exc
    try:
        _write(target, write)
    except ToolError:
        if all(_digest(target, rel) == sha256(data) for rel, data in originals.items()):
            try:  # no file replaced: forget them
                _forget(target, Forget())
            except OSError:
                pass
        raise


def _forget(target, step):
    """Remove the saved originals: state.json first (they count no longer), then the rest."""
    directory = _saved_dir(target)
    try:
        fault("unlink")
        (directory / STATE_FILE).unlink(missing_ok=True)
        _sync_dir(directory)
        shutil.rmtree(directory)
    except OSError as exc:
        if not step.failure:
            raise
        raise ToolError(f"{step.failure}: {exc}") from exc


def _drop(target, step):
    """Remove the saved originals' directory as it is (see Drop)."""
    if not step.leftover:
        shutil.rmtree(_saved_dir(target), ignore_errors=True)
        return
    shutil.rmtree(_saved_dir(target))
    if not any((target.root / target.subtree).iterdir()):
        (target.root / target.subtree).rmdir()


def _git_am(target, step):
    git_am(target.root, step.patches, include=step.include)


def _git_reset(target, step):
    git(["reset", "-q", "--keep", f"HEAD~{step.count}"], target.root, shielded=True)


_STEPS = {
    Tidy: _tidy,
    Write: _write,
    Save: _save,
    Forget: _forget,
    Drop: _drop,
    GitAm: _git_am,
    GitReset: _git_reset,
}


def _digest(target, rel):
    path = target.root / rel
    return sha256_of(path) if path.is_file() else None


def _checked_state(target, before, contents):
    """What the files are now, read back after a failure: as before, or written."""
    now = {}
    for rel, data in contents.items():
        digest = _digest(target, rel)
        if digest == before[rel]:
            now[rel] = "as before"
        else:
            now[rel] = "written" if digest == sha256(data) else "changed otherwise"
    if set(now.values()) == {"as before"}:
        return "nothing was changed (checked)"
    listing = ", ".join(f"{rel}: {state}" for rel, state in sorted(now.items()))
    return f"checked: {listing}; run apply again to complete the series, or revert to undo it"
