"""Packaging of the FusedAdam state_dict CPU offload patch series for TransformerEngine.

Installs the tool, the package te_fusedadam_offload/ (command te-fusedadam-offload), with the
series (patches/, series.toml, upstream.json, compat/) as its data.
"""

import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
MODULE = "te_fusedadam_offload"
DATA = ["upstream.json", "series.toml", "patches", "compat"]
# The version is written once, in the package.
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (HERE / MODULE / "__init__.py").read_text(encoding="utf-8"), re.M
).group(1)


class BuildWithSeries(build_py):
    """Copy the series into the package, as te_fusedadam_offload/_data."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / MODULE / "_data"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for name in DATA:
            src = HERE / name
            if src.is_dir():
                shutil.copytree(src, dest / name)
            else:
                shutil.copyfile(src, dest / name)


setup(
    name="te-fusedadam-offload",
    version=VERSION,
    description=(
        "FusedAdam(state_dict_cpu_offload=True) for NVIDIA TransformerEngine, as a patch "
        "series with a tool that applies, checks and reverts it"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # The package and its subpackages.
    packages=find_packages(include=[MODULE, MODULE + ".*"]),
    install_requires=['tomli>=1.1; python_version < "3.11"'],
    # The tool needs no torch; the stager (and gpu_check) do, and numpy with it: DCP's save
    # and load exchange their plans with gather_object, which torch unpickles through numpy
    # ("Numpy is not available" at the first checkpoint without it). No version bounds, so
    # that pip never replaces the torch of an environment (a container's CUDA build, say) or
    # its numpy: docs/tool.rst says which releases were tested.
    extras_require={"staging": ["torch", "numpy"]},
    entry_points={"console_scripts": [f"te-fusedadam-offload={MODULE}.__main__:main"]},
    cmdclass={"build_py": BuildWithSeries},
)
