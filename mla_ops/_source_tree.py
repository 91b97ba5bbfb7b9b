"""``lowering/`` sits beside the package in the source tree (DESIGN §5) and installs as the
subpackage ``mla_ops.lowering`` (pyproject ``package-dir``). Run from a plain checkout on
``sys.path`` (no install, as the GPU script does), the subpackage is not inside ``mla_ops/``:
then it is reached in its folder, under the same name."""

from __future__ import annotations

import os


def alias_lowering(package_path: list[str]) -> None:
    here = package_path[0]
    if os.path.isdir(os.path.join(here, "lowering")):
        return  # installed: a real subpackage
    source = os.path.join(os.path.dirname(here), "lowering")
    if os.path.isfile(os.path.join(source, "__init__.py")) and source not in package_path:
        package_path.append(os.path.dirname(source))  # mla_ops.lowering -> <checkout>/lowering
