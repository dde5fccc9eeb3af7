"""The series itself: the pin, the stack of pull requests and its cover letters, and what
the patches add."""

import ast
import re
import shutil
import sys

import pytest
from support import FUSED_ADAM

from te_fusedadam_offload import actions, series, target, upstream
from te_fusedadam_offload.errors import ToolError


def test_pin_matches_the_downloaded_release(pristine):
    pin = upstream.load_pin()
    wheel = upstream.fetch_pinned()
    assert wheel.name == pin["artifact"]
    assert upstream.sha256_of(wheel) == pin["sha256"]
    assert (pristine / FUSED_ADAM).is_file()
    before, _ = series.load_checksums()[FUSED_ADAM]
    assert upstream.sha256_of(pristine / FUSED_ADAM) == before


def test_wrong_hash_is_refused(tmp_path):
    wheel = upstream.fetch_pinned()
    bad = tmp_path / wheel.name
    shutil.copyfile(wheel, bad)
    with open(bad, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ToolError, match="does not match the pinned"):
        upstream.fetch_pinned(bad)
    with pytest.raises(ToolError, match="does not exist"):
        upstream.fetch_pinned(tmp_path / "missing.whl")


def _module_imports(path):
    """The modules that a Python file imports at module scope."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_series_adds_no_torch_import_at_module_scope(tree, pristine):
    """`import transformer_engine.pytorch` must not depend on a private torch module: the
    series imports only standard-library modules at module scope of fused_adam.py (no torch
    module, and no module of TE's, which a relative import would name)."""
    actions.apply(target.find_target(tree))
    added = _module_imports(tree / FUSED_ADAM) - _module_imports(pristine / FUSED_ADAM)
    assert all(name.split(".")[0] in sys.stdlib_module_names for name in added), added


def test_series_is_a_stack_of_pull_requests_with_cover_letters():
    """patches/<n>-<name>/: format-patch output per pull request, numbered from 1 in each, with
    a cover letter in TE's template; every patch signed off by the placeholder identity."""
    stack = series.pr_patch_files()
    prs = series.load_series()["pr"]
    assert [d.name for d, _ in stack] == [series.pr_dir_name(n, pr) for n, pr in enumerate(prs, 1)]
    placeholder = "{} <{}>".format(*series.PLACEHOLDER_IDENTITY)
    for number, (pr_dir, patches) in enumerate(stack, 1):
        names = [p.name for p in patches]
        assert names == sorted(names) and names[0].startswith("0001-")
        cover = (pr_dir / "0000-cover-letter.patch").read_text(encoding="utf-8")
        assert "*** SUBJECT HERE ***" not in cover and "*** BLURB HERE ***" not in cover
        assert f"[PATCH 0/{len(patches)}]" in cover
        assert "sha256 " + upstream.load_pin()["sha256"] in cover
        kinds = cover.split("## Type of change\n\n")[1].split("\n\n")[0]  # one checked
        assert kinds.startswith("- [") and kinds.count("- [x]") == 1, kinds
        # Each box is checked, or says why not yet (the stack as it is now has not run on a GPU),
        # or why it does not apply (no docs change where nothing documented changes).
        for line in cover.split("# Checklist:")[1].split("\n\n")[1].splitlines():
            assert re.match(r"- \[x\] |- \[ \] .+ \((not yet|none needed): .+\)$", line), line
        assert ("Fixes #3668" in cover) == (number == 1)
        independent = prs[number - 1].get("independent", False)  # a carried upstream PR
        assert (',\non top of "[PyTorch]' in cover) == (number > 1 and not independent)
        assert ("alone: it depends on none of the pull requests before it" in cover) == independent
        for patch in patches:
            text = patch.read_text(encoding="utf-8")
            assert text.startswith("From 0000000000000000000000000000000000000000 ")
            assert f"\nFrom: {placeholder}\n" in text
            assert f"\nSigned-off-by: {placeholder}\n" in text


def test_first_pull_request_adds_at_most_200_lines_under_transformer_engine():
    """The export pull request stays small: what it adds under transformer_engine/."""
    added = 0
    for patch in series.pr_patch_files()[0][1]:
        path = None
        for line in patch.read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ "):
                path = line[len("+++ b/") :]
            elif line.startswith("+") and path and path.startswith("transformer_engine/"):
                added += 1
    assert 0 < added <= 200
