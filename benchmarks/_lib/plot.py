"""matplotlib for the benchmarks: the Agg backend (files only, no display) and one way to save."""

from __future__ import annotations

import os


def pyplot(optional: bool = False):
    """``matplotlib.pyplot`` on the Agg backend; None when ``optional`` and matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        if optional:
            return None
        raise
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | os.PathLike, dpi: int = 120) -> None:
    """Write ``fig`` to ``path`` (its folder made if missing) and close it."""
    import matplotlib.pyplot as plt

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
