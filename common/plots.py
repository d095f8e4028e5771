"""The reports' figures: one way to open, save and close a matplotlib figure (headless: Agg)."""

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def figure(path: Path, figsize: tuple[float, float] = (5, 3.5), ncols: int = 1):
    """The axes of a new figure (a tuple of ncols when ncols > 1), saved to `path` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize)
    try:
        yield axes
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
