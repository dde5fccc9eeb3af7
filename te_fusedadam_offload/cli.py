"""te-fusedadam-offload: the command line of the patch set."""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
from pathlib import Path

from . import __version__
from .drift import CONFLICT, drift
from .errors import EXIT_NEEDS, EXIT_NO, EXIT_NO_TARGET, EXIT_USAGE, ToolError
from .mainline import MAIN_DIR, check_main, main_source, main_tree
from .paths import repo_root
from .review import lint, signed_off
from .series import (
    STAGES_DIR,
    compare_dirs,
    entry_paths,
    generate,
    git,
    load_series,
    main_paths,
    patch_files,
    patches_dir,
    stage_dir,
    staged_paths,
)
from .target import (
    APPLIED,
    DRIFTED,
    NOT_APPLIED,
    Target,
    apply,
    apply_all,
    dry_run,
    file_report,
    find_target,
    notes,
    older_than_supported,
    other_version,
    revert,
    status,
    te_version,
)
from .upstream import fetch_pinned, load_pin, pristine_tree


def _repo():
    root = repo_root()
    if root is None:
        raise ToolError("this command works in a checkout of the patch set's repository")
    return root


def materialize(dest, wheel=None, source=None):
    """Pristine pinned TE + the series, unpacked into `dest`/transformer_engine; the files that
    several patches change also as they are after each patch, under `dest`/.stages/. If the
    series changes upstream main files and the pinned main tree is at hand (cached, or
    exported from `source` or $TE_SOURCE): that tree + the series in `dest`/te-main."""
    pin = load_pin()
    dest = Path(dest)
    tree, stages = dest / pin["subtree"], dest / STAGES_DIR
    main_root = main_tree(source) if main_paths() else None
    for path in (tree, stages, *([dest / MAIN_DIR] if main_root else [])):
        if path.exists():
            raise ToolError(
                f"{path} already exists; remove it first (after 'refresh', if it holds edits "
                "you want to keep)"
            )
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(pristine_tree(wheel) / pin["subtree"], tree)
    try:
        message = f"applied {apply_all(Target(dest, 'tree'), patch_files())} patch(es)"
        _write_stages(dest, wheel, main_root)
    except ToolError:
        shutil.rmtree(tree)
        shutil.rmtree(stages, ignore_errors=True)
        raise
    lines = [f"{tree}: {pin['package']} {pin['version']} + series ({message})"]
    if main_root is not None:
        lines.append(_materialize_main(main_root, dest / MAIN_DIR))
    elif main_paths():
        lines.append(
            f"SKIPPED: {dest / MAIN_DIR} (upstream main + the series, where its changes to "
            f"{len(main_paths())} upstream main files are edited): no TE source given; pass "
            "--source or set TE_SOURCE to a TransformerEngine git clone"
        )
    return "\n".join(lines)


def _materialize_main(main_root, dest):
    """The pinned main tree + the whole series, in `dest`."""
    main_pin = load_pin()["main"]
    shutil.copytree(main_root, dest, ignore=shutil.ignore_patterns(".commit"))
    try:
        applied = apply_all(Target(dest, "checkout"), patch_files())
    except ToolError:
        shutil.rmtree(dest)
        raise
    return (
        f"{dest}: upstream main {main_pin['commit'][:12]} ({main_pin['date']}) + series "
        f"(applied {applied} patch(es))"
    )


def _write_stages(dest, wheel=None, main_root=None):
    """Write .stages/NNNN/<path>: each file that a later patch changes again, after patch NNNN
    (upstream main files only with the pinned main tree, `main_root`)."""
    staged = staged_paths()
    if not staged:
        return
    subtree = load_pin()["subtree"]
    changed_main = main_paths()
    held = [f"{subtree}/*"] + [
        rel
        for entry in load_series()["patch"]
        for rel in entry_paths(entry)
        if not rel.startswith(subtree + "/") and (main_root is not None or rel not in changed_main)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(pristine_tree(wheel) / subtree, Path(tmp) / subtree)
        for rel in changed_main if main_root is not None else ():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(main_root) / rel, Path(tmp) / rel)
        for index, patch in enumerate(patch_files()):
            git(
                ["apply", *(f"--include={rel}" for rel in held), str(patch)],
                tmp,
                {"GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)},
            )
            for rel in staged.get(index, ()):
                if (Path(tmp) / rel).is_file():
                    out = Path(dest) / stage_dir(index) / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(tmp) / rel, out)


def cmd_materialize(args):
    """Unpack the pinned release and apply the series for reading, editing and testing."""
    print(materialize(args.dest or _repo(), args.wheel, args.source))


def _series_sources(tree_root, overlay, with_main=True):
    """Make `overlay` a directory laid out like the repository, with the release's files from
    `tree_root`, the upstream main files from `tree_root`/te-main (unless not `with_main`)
    and the repository's own files of the series."""
    repo = _repo()
    subtree = load_pin()["subtree"]
    changed_main = main_paths()
    for entry in load_series()["patch"]:
        for rel in entry_paths(entry):
            if rel in changed_main:
                if not with_main:
                    continue
                src = Path(tree_root) / MAIN_DIR / rel
                if not src.is_file():
                    raise ToolError(f"{src} does not exist; run 'materialize' with a TE source")
            else:
                src = (Path(tree_root) if rel.startswith(subtree + "/") else repo) / rel
            dst = overlay / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_file():
                shutil.copyfile(src, dst)
    for index, paths in staged_paths().items():
        for rel in paths:
            if rel in changed_main and not with_main:
                continue
            src = Path(tree_root) / stage_dir(index) / rel
            if not src.is_file():
                raise ToolError(
                    f"{src} does not exist: {rel} is changed by several patches, and this is "
                    "its content after the first of them; run 'materialize'"
                )
            dst = overlay / stage_dir(index) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return overlay


def cmd_refresh(args):
    """Regenerate patches/ from the materialized trees and the repository's own files."""
    repo = _repo()
    subtree = load_pin()["subtree"]
    changed_main = main_paths()
    main_root = main_tree(args.source) if changed_main else None
    # Without the main tree, the diffs of the main files cannot be made: only --check runs.
    partial = bool(changed_main) and main_root is None
    if partial and not args.check:
        raise ToolError(
            "the series changes upstream main files; pass --source or set TE_SOURCE "
            "to a TransformerEngine git clone holding the pinned main commit"
        )
    with tempfile.TemporaryDirectory() as tmp:
        if args.check:
            # From a fresh clone: the series applied to the pristine release (and main) must
            # regenerate itself byte for byte, together with the repository's own files.
            materialize(Path(tmp) / "tree", args.wheel, args.source)
            tree_root = Path(tmp) / "tree"
        else:
            tree_root = repo
            if not (repo / subtree).is_dir():
                raise ToolError(f"{repo / subtree} does not exist; run 'materialize' first")
            if changed_main and not (repo / MAIN_DIR).is_dir():
                raise ToolError(f"{repo / MAIN_DIR} does not exist; run 'materialize' first")
        overlay = _series_sources(tree_root, Path(tmp) / "sources", with_main=not partial)
        out = generate(overlay, Path(tmp) / "out", args.wheel, main_root)
        changed = compare_dirs(patches_dir(), out, changed_main if partial else ())
        if args.check:
            if changed:
                raise ToolError("patches/ is stale: 'refresh' would change " + ", ".join(changed))
            print(f"patches/ is up to date ({len(patch_files())} patches)")
            if partial:
                print(
                    f"SKIPPED: the diffs of {len(changed_main)} upstream main files "
                    f"({', '.join(changed_main)}) and the diffstats were not regenerated: no "
                    "TE source given (set TE_SOURCE to a TransformerEngine git clone); their "
                    "commit messages and every other diff were regenerated and match"
                )
            return
        dest = patches_dir()
        shutil.rmtree(dest)
        shutil.copytree(out, dest)
    print("patches/ refreshed" + (": " + ", ".join(changed) if changed else " (no change)"))


def _target(args):
    return find_target(args.path, args.installed, args.python)


def _print_status(target):
    rows, overall = status(target)
    print(f"{target}: {overall}")
    for name, state, detail in rows:
        print(f"  {name}: {state}" + (f" ({detail})" if detail else ""))
    return overall


def cmd_status(args):
    """Tell whether the series is applied, not applied, interrupted or drifted, per patch and
    file. Exit 0 if it is applied, 1 otherwise."""
    target = _target(args)
    if args.json:
        rows, overall = status(target)
        report = {
            "target": str(target.root),
            "kind": target.kind,
            "te_version": te_version(target),
            "series_for": load_pin()["version"],
            "status": overall,
            "patches": [
                {"patch": name, "state": state, "detail": detail} for name, state, detail in rows
            ],
            "files": [{"path": rel, "state": what} for rel, what in file_report(target, overall)],
            "notes": notes(target, overall),
        }
        print(json.dumps(report, indent=2))
    else:
        overall = _print_status(target)
        for rel, state in file_report(target, overall):
            print(f"  {rel}: {state}")
        for note in notes(target, overall):
            print(f"note: {note}")
    return 0 if overall == APPLIED else 1


def cmd_check(args):
    """Exit 0 if the series is applied or apply would apply it (or complete it, or replace
    another version of it), 1 if the target drifted or is a TE older than supported."""
    target = _target(args)
    overall, found = _print_status(target), te_version(target)
    if overall == NOT_APPLIED and older_than_supported(found):
        print(f"  TE {found} is older than the releases the series supports")
        return 1
    if overall != DRIFTED:
        return 0
    if other_version(target):
        print("  another version of this series is applied; apply replaces it")
        return 0
    return 1


def cmd_apply(args):
    """Apply the series (idempotent, all or nothing); with --dry-run, show what it would
    change and change nothing."""
    target = _target(args)
    if args.dry_run:
        message, diff = dry_run(target)
        sys.stdout.write(diff)
        print(f"dry run: {target}: {message}; nothing was changed")
        return
    print(f"{target}: {apply(target)}")
    _, overall = status(target)
    if overall != APPLIED:
        raise ToolError(f"after applying, the series reads as {overall}")


def cmd_revert(args):
    """Take the series out, restoring the exact files it changed."""
    target = _target(args)
    print(f"{target}: {revert(target)}")
    for rel, state in file_report(target, NOT_APPLIED):
        print(f"  {rel}: {state}")


def cmd_drift(args):
    """Try the series against other releases (default: every release the series supports
    and the newest); exit 1 if one conflicts, 4 if one could not be downloaded."""
    conflict = missing = False
    for version, sha, rows, note in drift(args.versions):
        print(f"{load_pin()['package']} {version}" + (f" (sha256 {sha})" if sha else "") + ":")
        for name, result, detail in rows:
            print(f"  {name}: {result}" + (f" ({detail})" if detail else ""))
            conflict = conflict or result == CONFLICT
        if note:
            print(f"  note: {note}")
        missing = missing or sha is None
        sys.stdout.flush()
    return EXIT_NO if conflict else EXIT_NEEDS if missing else 0


def cmd_check_main(args):
    """git am the series onto the pinned upstream main commit, in a scratch clone of a TE
    git repository (SOURCE, or $TE_SOURCE), which is left unchanged."""
    source = main_source(args.source)
    if not source:
        raise ToolError("no TE source given: pass the path of a TransformerEngine git clone")
    print(check_main(source))


def cmd_lint(args):
    """Run TE's lint job (pylint 3.3.1 with TE's pylintrc, black 24.4.2, vermin) on the pinned
    main tree with each prefix of the stack of pull requests; exit 1 if it fails."""
    main_root = main_tree(args.source)
    if main_root is None:
        raise ToolError(
            "TE's lint job runs on the pinned main tree: pass --source or set TE_SOURCE to a "
            "TransformerEngine git clone holding the pinned main commit"
        )
    ok, report = lint(main_root)
    print(report)
    return 0 if ok else 1


def cmd_pr(args):
    """Write the stack of pull requests signed off by you (your git identity, or --identity),
    ready for git am / git send-email; the committed patches carry a placeholder."""
    print(signed_off(args.out, args.identity))


def cmd_fetch(args):
    """Download and verify the pinned release; print its path."""
    print(fetch_pinned(args.wheel))


EXIT_CODES = f"""exit status:
  0  success (status: the series is applied)
  {EXIT_NO}  no: not applied or drifted (status), drifted (check), refused or stopped
     (apply, revert: the message says what the files are), a failed check (maintainers)
  {EXIT_USAGE}  bad arguments
  {EXIT_NO_TARGET}  no TE where named: no such directory, no transformer_engine/ in it, none
     installed in the Python, or only what apply saved left by an uninstall of TE
  {EXIT_NEEDS}  something the tool needs is missing or unreachable: git, the Python of
     --python, the package index
  141  the reader of the output went away (status | head -1)"""


def build_parser():
    """The argument parser: the commands for users first, then those for maintainers of the
    series, which work in a checkout of its repository."""
    parser = argparse.ArgumentParser(
        prog="te-fusedadam-offload",
        description=(
            "Apply, check and revert the FusedAdam state_dict_cpu_offload patch series on a\n"
            "TransformerEngine: the one installed in this Python (the default), the one of\n"
            "another Python (--python), a source checkout, or a directory holding\n"
            "transformer_engine/. The commands marked [maintainers] make and check the series\n"
            "itself; most of them work in a checkout of its repository."
        ),
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name, func, help_text):
        p = sub.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(" ".join(help_text.split()), 80),
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(func=func)
        return p

    for name, func in (
        ("apply", cmd_apply),
        ("status", cmd_status),
        ("check", cmd_check),
        ("revert", cmd_revert),
    ):
        p = add(name, func, func.__doc__)
        group = p.add_mutually_exclusive_group()
        group.add_argument(
            "path",
            nargs="?",
            help="a TE source checkout or a directory holding transformer_engine/",
        )
        group.add_argument(
            "--installed",
            action="store_true",
            help="the TE installed in this Python environment (the default without a path)",
        )
        group.add_argument(
            "--python",
            metavar="PYTHON",
            help=(
                "the TE installed in the environment of this Python interpreter (for a "
                "tool installed elsewhere, e.g. with pipx): --python /path/to/venv/bin/python"
            ),
        )
        if name == "apply":
            p.add_argument(
                "--dry-run",
                action="store_true",
                help="print the diff that apply would make, and change nothing",
            )
        if name == "status":
            p.add_argument("--json", action="store_true", help="print the report as JSON")

    maintainer = "[maintainers] "
    wheel_help = "use this copy of the pinned wheel instead of downloading it (checked by sha256)"
    source_help = (
        "a TransformerEngine git clone holding the pinned main commit, for the series' changes "
        "to upstream main files (default: $TE_SOURCE; once exported, the tree is cached)"
    )
    p = add("fetch", cmd_fetch, maintainer + cmd_fetch.__doc__)
    p.add_argument("--wheel", help=wheel_help)
    p = add("materialize", cmd_materialize, maintainer + cmd_materialize.__doc__)
    p.add_argument("--dest", help="directory to hold transformer_engine/ (default: the repo)")
    p.add_argument("--wheel", help=wheel_help)
    p.add_argument("--source", help=source_help)
    p = add("refresh", cmd_refresh, maintainer + cmd_refresh.__doc__)
    p.add_argument(
        "--check", action="store_true", help="only check that patches/ is up to date (for CI)"
    )
    p.add_argument("--wheel", help=wheel_help)
    p.add_argument("--source", help=source_help)
    p = add("drift", cmd_drift, maintainer + cmd_drift.__doc__)
    p.add_argument(
        "versions",
        nargs="*",
        help="releases to try (default: every release the series supports, and the newest)",
    )
    p = add("check-main", cmd_check_main, maintainer + cmd_check_main.__doc__)
    p.add_argument("source", nargs="?", help="a TransformerEngine git clone (default: $TE_SOURCE)")
    p = add("lint", cmd_lint, maintainer + cmd_lint.__doc__)
    p.add_argument("--source", help=source_help)
    p = add("pr", cmd_pr, maintainer + cmd_pr.__doc__)
    p.add_argument("--signoff", action="store_true", required=True, help="sign off as yourself")
    p.add_argument("--out", required=True, help="a new directory for the signed-off stack")
    p.add_argument("--identity", help="'Name <email>' instead of your git identity")
    return parser


def main(argv=None):
    """Entry point; returns the exit status (EXIT_CODES)."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # here, so that a closed pipe is caught below
        return code
    except ToolError as exc:
        sys.stdout.flush()
        print(f"te-fusedadam-offload {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # The reader of our output went away (`status | head -1`): stop quietly, and keep the
        # interpreter from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
