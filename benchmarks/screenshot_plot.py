"""The README's picture: the GPT-2 example planned at 50%, its step drawn (``autoremat.plot``)
and photographed in headless Chromium (``autoremat.picture.browser.screenshot``).
``tests/test_picture_browser.py`` runs the same :func:`example_picture` (on a smaller
example, for time) and checks the shot.

    python benchmarks/screenshot_plot.py          # writes docs/plot-gpt2.png
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import autoremat
from autoremat.examples import EXAMPLES
from autoremat.picture.browser import Shot, screenshot

# the window the page is photographed in (pixels): the whole figure, nothing more
SIZE = (1240, 760)


def example_picture(name: str, folder: Path, png: Path | None = None, budget: str = "50%") -> Shot:
    """The built-in example ``name``'s plan at ``budget`` drawn, measured too, into
    ``folder``/NAME.html and photographed (into ``png``, by default beside it)."""
    model, args, kwargs = EXAMPLES[name]()
    plan = autoremat.plan(model, args, kwargs, budget=budget)
    page = autoremat.plot(plan, folder / f"{name}.html", model, args, kwargs, measure=True)
    return screenshot(page, png or folder / f"{name}.png", SIZE)


def main() -> None:
    docs = Path(__file__).resolve().parents[1] / "docs"
    with tempfile.TemporaryDirectory() as folder:
        shot = example_picture("gpt2", Path(folder), docs / "plot-gpt2.png")
    print(f"wrote {shot.png} ({shot.png.stat().st_size / 1024:.0f} KiB)")
    if shot.messages:
        sys.exit(f"the page logged: {shot.messages}")


if __name__ == "__main__":
    main()
