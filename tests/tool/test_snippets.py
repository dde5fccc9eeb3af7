"""The snippets of README.md and docs/ run as written. Each code block runs here, on CPU, or
says why not in a comment just above it (`<!-- not run...: why -->` in Markdown, `.. not run...:
why` in reST). Python blocks run in a process of their own, with `model`, `optimizer`,
`train_step()` and `path` (the user's) given, torch.optim.Adam standing in for TE's FusedAdam,
in a one-process gloo group; every Python block, run or not, compiles and uses no other name
it does not define or import. Shell blocks run in order, each with `bash -e`, in a new venv
holding the pinned TE release, as a new user would run them. The upstream page (docs/features/)
is not this repository's to annotate: its blocks need TE and a GPU, and are only compiled."""

import builtins
import os
import re
import subprocess
import sys
import symtable
import zipfile
from dataclasses import dataclass

import pytest
from support import EXIT_WITHOUT_FINALIZING, FUSED_ADAM, REPO, purelib, release_wheel

from te_fusedadam_offload import upstream

UPSTREAM_PAGE = REPO / "docs" / "features"
GIVEN = {"model", "optimizer", "train_step", "path"}  # the user's, that a snippet may use


@dataclass
class Block:
    """A code block: where it is, its language, its code, and why it is not run (or None)."""

    where: str
    lang: str
    code: str
    not_run: str | None


def _annotation(lines, before, pattern):
    """The reason of a `not run` comment on the nearest non-blank line above `before`."""
    for line in reversed(lines[:before]):
        if line.strip():
            found = re.match(pattern, line.strip())
            return found.group(1) if found else None
    return None


def markdown_blocks(path):
    """The fenced blocks of a Markdown file; it has no indented code blocks."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)$", lines[i])
        if fence:
            end = lines.index("```", i + 1)
            reason = _annotation(lines, i, r"^<!-- not run[^:]*: (.+) -->$")
            code = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(f"{path.name}:{i + 1}", fence.group(1), code, reason))
            i = end + 1
            continue
        indented = lines[i].startswith("    ") and i > 0 and not lines[i - 1].strip()
        assert not indented, f"{path.name}:{i + 1}: an indented code block; fence it"
        i += 1
    return found


def rst_blocks(path):
    """The `.. code-block::` blocks of a reST file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        directive = re.match(r"^( *)\.\. code-block:: *(\w+)$", line)
        if not directive:
            continue
        indent, body = len(directive.group(1)), []
        for more in lines[i + 1 :]:
            if more.strip() and len(more) - len(more.lstrip()) <= indent:
                break
            body.append(more)
        code = "\n".join(body).strip("\n")
        width = min(len(l) - len(l.lstrip()) for l in code.splitlines() if l.strip())
        code = "\n".join(l[width:] for l in code.splitlines()) + "\n"
        reason = _annotation(lines, i, r"^\.\. not run[^:]*: (.+)$")
        if path.is_relative_to(UPSTREAM_PAGE):
            reason = "the upstream page: TE with the series and a GPU"
        found.append(Block(f"{path.relative_to(REPO)}:{i + 1}", directive.group(2), code, reason))
    return found


def all_blocks():
    """Every code block of README.md and docs/, in order."""
    docs = sorted((REPO / "docs").rglob("*.rst"))
    return markdown_blocks(REPO / "README.md") + [b for d in docs for b in rst_blocks(d)]


BLOCKS = all_blocks()


def free_names(code):
    """The names a Python block uses at module level or as globals of its functions that it
    neither assigns, imports nor defines (builtins aside)."""
    table = symtable.symtable(code, "<snippet>", "exec")
    defined = {
        s.get_name()
        for s in table.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    used = set()
    stack = [table]
    while stack:
        scope = stack.pop()
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and (scope is table or symbol.is_global()):
                used.add(symbol.get_name())
        stack.extend(scope.get_children())
    return used - defined - set(dir(builtins))


def test_every_block_runs_or_says_why_not():
    assert [b for b in BLOCKS if b.lang == "python" and b.not_run is None], "none to run"
    for block in BLOCKS:
        if block.not_run is None:
            assert block.lang in ("python", "sh"), f"{block.where}: {block.lang} is not run"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_block_compiles_and_imports_what_it_uses(block):
    compile(block.code, block.where, "exec")
    if block.where.startswith("docs/features/"):
        return  # upstream style: the page's snippets leave out the imports
    assert free_names(block.code) <= GIVEN, f"{block.where}: used but not imported or defined"


# What a snippet that uses the user's objects gets: a CPU model, torch.optim.Adam standing in
# for TE's FusedAdam (its states exist: one step), a training step that changes both, a new
# directory, a one-process gloo group; the process then ends as EXIT_WITHOUT_FINALIZING says.
PRELUDE = """
import os, sys, tempfile
import torch
import torch.distributed as dist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

def train_step():
    optimizer.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()

train_step()
path = tempfile.mkdtemp(prefix="snippet-")
where, code = sys.argv[1], open(sys.argv[2], encoding="utf-8").read()
given = {"model": model, "optimizer": optimizer, "train_step": train_step, "path": path}
exec(compile(code, where, "exec"), given)
dist.destroy_process_group()
"""
PRELUDE += EXIT_WITHOUT_FINALIZING


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.lang == "python" and b.not_run is None],
    ids=lambda b: b.where,
)
def test_python_block_runs(block, tmp_path):
    (tmp_path / "snippet.py").write_text(block.code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE, block.where, str(tmp_path / "snippet.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{block.where}:\n{result.stderr}"


def test_the_async_checkpoint_recipe_is_run():
    """docs/checkpointing.rst's recipe runs here as one block (test_python_block_runs): its
    checkpoints through the stager, the waits on what async_save returned (an AsyncSaveResponse
    with async_staging=True: a wait on anything else raises there), the resume into the
    stager's template through ParallelFileSystemReader, and training on."""
    recipes = [b for b in BLOCKS if "async_stager=stager" in b.code and b.not_run is None]
    assert [b.where.split(":")[0] for b in recipes] == ["docs/checkpointing.rst"]
    code = recipes[0].code
    for needed in (
        "async_staging=True",
        "load_template(",
        "ParallelFileSystemReader(",
        "train_step()",
    ):
        assert needed in code, needed
    assert code.count(".result()") == code.count(".upload_completion.result()") > 0


def test_shell_blocks_run_in_order_as_a_new_user_would(tmp_path):
    """A new venv with the pinned TE release (from its wheel), then each shell block of the
    README that is not marked, in order, with `bash -e` in the checkout: install, apply,
    status, the container's install, revert and uninstall; TE is then as released."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    wheel = release_wheel(upstream.load_pin()["version"])
    subprocess.run(
        ["pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=env, check=True
    )
    blocks = [b for b in BLOCKS if b.lang == "sh" and b.not_run is None]
    assert [b.where.split(":")[0] for b in blocks] == ["README.md"] * len(blocks)
    ran = []
    for block in blocks:
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"{block.where}:\n{result.stdout}\n{result.stderr}"
        ran.append(block.code)
    assert any("apply --installed" in c for c in ran) and "revert --installed" in ran[-1]
    site = purelib(venv / "bin" / "python")
    with zipfile.ZipFile(wheel) as zf:
        assert (site / FUSED_ADAM).read_bytes() == zf.read(FUSED_ADAM)
    assert not (site / "te_fusedadam_offload").exists()


def test_the_configuration_snippets_name_the_option_and_a_real_target(pristine):
    """The Hydra/NeMo-style YAML blocks (docs/checkpointing.rst's, NeMo Automodel's in
    docs/frameworks.rst): FusedAdam's import path as TE has it, through a package that imports
    it or the module that defines it, and the option."""
    blocks = [b for b in BLOCKS if b.lang == "yaml"]
    assert [b.where.split(":")[0] for b in blocks] == [
        "docs/checkpointing.rst",
        "docs/frameworks.rst",
    ]
    for block in blocks:
        target = re.search(r"_target_: *(\S+)", block.code).group(1)
        module, _, name = target.rpartition(".")
        where = pristine / module.replace(".", "/")
        init = where / "__init__.py"
        if init.is_file():  # a package: it imports the class
            found = re.search(rf"\bimport\b.*\b{name}\b", init.read_text(encoding="utf-8"))
        else:  # a module: it defines the class
            found = re.search(
                rf"^class {name}\b", where.with_suffix(".py").read_text("utf-8"), re.M
            )
        assert found, f"{block.where}: {target}"
        assert re.search(r"^\s*state_dict_cpu_offload: true$", block.code, re.M), block.where


def test_each_way_out_that_reinstalls_te_says_to_delete_what_apply_saved():
    """A reinstall of TE gives back its files but leaves what apply saved, which pip does not
    know about: where the README or docs/ tell to reinstall TE to take the series out, the
    paragraph says to delete transformer_engine/.te_fusedadam_offload/ too."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.rst"))]
    for page in pages:
        for paragraph in re.split(r"\n\s*\n", page.read_text(encoding="utf-8")):
            if "--force-reinstall" in paragraph:
                assert ".te_fusedadam_offload" in paragraph, (page.name, paragraph)
