"""``lowering/`` sits beside the package in the source tree (DESIGN §5) and installs as the
subpackage ``mla_ops.lowering`` (pyproject ``package-dir``). Run from a plain checkout on
``sys.path`` (no install, as the GPU script does), that subpackage is not inside ``mla_ops/``:
then exactly that name is found in its folder, nothing else."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

NAME = "mla_ops.lowering"


class _LoweringFinder(importlib.abc.MetaPathFinder):
    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        init = os.path.join(self.folder, "__init__.py")
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[self.folder])


def alias_lowering(package_path: list[str]) -> None:
    here = package_path[0]
    source = os.path.join(os.path.dirname(here), "lowering")
    if os.path.isdir(os.path.join(here, "lowering")) or not os.path.isfile(os.path.join(source, "__init__.py")):
        return  # installed (a real subpackage), or no source tree beside the package
    if importlib.util.find_spec(NAME) is None and not any(isinstance(f, _LoweringFinder) for f in sys.meta_path):
        sys.meta_path.append(_LoweringFinder(source))
