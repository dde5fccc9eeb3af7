"""The maintainers' engine and commands: materialize the trees to edit, refresh patches/ from
them, and the checks of the series (drift, check-main, lint) and its sign-off (pr). Most of
them work in a checkout of this repository; cli.py lists them after the users' commands."""

import shutil
import sys
import tempfile
from pathlib import Path

from .drift import CONFLICT, drift
from ..errors import EXIT_NEEDS, EXIT_NO, ToolError, UsageError
from .generate import compare_dirs, generate
from .mainline import MAIN_DIR, NO_MAIN_TREE, check_main, main_tree
from ..patching import apply_in_order
from ..paths import repo_root
from .review import lint, signed_off
from ..series import (
    STAGES_DIR,
    entry_paths,
    load_series,
    main_paths,
    patch_files,
    patches_dir,
    stage_dir,
    staged_paths,
)
from ..target import Target
from ..upstream import fetch_pinned, load_pin, pristine_tree


def _repo():
    root = repo_root()
    if root is None:
        raise UsageError("this command works in a checkout of the patch set's repository")
    return root


def materialize(dest, wheel=None, source=None):
    """Pristine pinned TE + the series, unpacked into `dest`/transformer_engine; the files that
    several patches change also as they are after each patch, under `dest`/.stages/. If the
    series changes upstream main files and the pinned main tree is at hand (cached, or
    exported from `source`, $TE_SOURCE or the pinned archive): that tree + the series in
    `dest`/te-main."""
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
        message = f"applied {Target(dest, 'tree').patch(patch_files())} patch(es)"
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
            f"{len(main_paths())} upstream main files are edited): {NO_MAIN_TREE}"
        )
    return "\n".join(lines)


def _materialize_main(main_root, dest):
    """The pinned main tree + the whole series, in `dest`."""
    main_pin = load_pin()["main"]
    shutil.copytree(main_root, dest, ignore=shutil.ignore_patterns(".commit"))
    try:
        applied = Target(dest, "checkout").patch(patch_files())
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
        for index, _ in enumerate(apply_in_order(tmp, patch_files(), held, check=True)):
            for rel in staged.get(index, ()):
                if (Path(tmp) / rel).is_file():
                    out = Path(dest) / stage_dir(index) / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(tmp) / rel, out)


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


def refresh(check=False, wheel=None, source=None):
    """Regenerate patches/ from the materialized trees and the repository's own files (with
    `check`: from a fresh materialization, and only compare). Returns the report."""
    repo = _repo()
    subtree = load_pin()["subtree"]
    changed_main = main_paths()
    main_root = main_tree(source) if changed_main else None
    # Without the main tree, the diffs of the main files cannot be made: only --check runs.
    partial = bool(changed_main) and main_root is None
    if partial and not check:
        raise ToolError(f"the series changes upstream main files: {NO_MAIN_TREE}")
    with tempfile.TemporaryDirectory() as tmp:
        if check:
            # From a fresh clone: the series applied to the pristine release (and main) must
            # regenerate itself byte for byte, together with the repository's own files.
            materialize(Path(tmp) / "tree", wheel, source)
            tree_root = Path(tmp) / "tree"
        else:
            tree_root = repo
            if not (repo / subtree).is_dir():
                raise ToolError(f"{repo / subtree} does not exist; run 'materialize' first")
            if changed_main and not (repo / MAIN_DIR).is_dir():
                raise ToolError(f"{repo / MAIN_DIR} does not exist; run 'materialize' first")
        overlay = _series_sources(tree_root, Path(tmp) / "sources", with_main=not partial)
        out = generate(overlay, Path(tmp) / "out", wheel, main_root)
        changed = compare_dirs(patches_dir(), out, changed_main if partial else ())
        if check:
            if changed:
                raise ToolError("patches/ is stale: 'refresh' would change " + ", ".join(changed))
            report = f"patches/ is up to date ({len(patch_files())} patches)"
            if partial:
                report += (
                    f"\nSKIPPED: the diffs of {len(changed_main)} upstream main files "
                    f"({', '.join(changed_main)}) and the diffstats were not regenerated "
                    f"({NO_MAIN_TREE}); their commit messages and every other diff were "
                    "regenerated and match"
                )
            return report
        dest = patches_dir()
        shutil.rmtree(dest)
        shutil.copytree(out, dest)
    return "patches/ refreshed" + (": " + ", ".join(changed) if changed else " (no change)")


def cmd_fetch(args):
    """Download and verify the pinned release; print its path."""
    print(fetch_pinned(args.wheel))


def cmd_materialize(args):
    """Unpack the pinned release and apply the series for reading, editing and testing."""
    print(materialize(args.dest or _repo(), args.wheel, args.source))


def cmd_refresh(args):
    """Regenerate patches/ from the materialized trees and the repository's own files."""
    print(refresh(args.check, args.wheel, args.source))


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
    """git am each pull request of the stack in turn onto the pinned upstream main commit's
    tree, in a scratch repository (the tree from a TE git repository, SOURCE or $TE_SOURCE,
    which is left unchanged, else cached or from the pinned archive)."""
    print(check_main(args.source))


def cmd_lint(args):
    """Run TE's lint job (pylint 3.3.1 with TE's pylintrc, black 24.4.2, vermin) on the pinned
    main tree with each prefix of the stack of pull requests; exit 1 if it fails."""
    main_root = main_tree(args.source)
    if main_root is None:
        raise ToolError(f"TE's lint job runs on the pinned main tree: {NO_MAIN_TREE}")
    ok, report = lint(main_root)
    print(report)
    return 0 if ok else 1


def cmd_pr(args):
    """Write the stack of pull requests signed off by you (your git identity, or --identity),
    ready for git am / git send-email; the committed patches carry a placeholder."""
    print(signed_off(args.out, args.identity))


MAINTAINERS_COMMANDS = ("fetch", "materialize", "refresh", "drift", "check-main", "lint", "pr")


def add_commands(add):
    """Add the maintainers' commands with `add(name, function, help)` (cli.build_parser's)."""
    maintainer = "[maintainers] "
    wheel_help = "use this copy of the pinned wheel instead of downloading it (checked by sha256)"
    source_help = (
        "a TransformerEngine git clone holding the pinned main commit, for the series' changes "
        "to upstream main files (default: $TE_SOURCE, else the pinned archive of its tree, "
        "$TE_MAIN_ARCHIVE or ../shared/upstream/; once exported, the tree is cached)"
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
