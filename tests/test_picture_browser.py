"""The picture's page rendered in headless Chromium (issue 41): a screenshot shows the curves
and the budget line (not a blank page), and the page logged nothing. The page and the shot
are made by ``benchmarks/screenshot_plot.py``'s :func:`example_picture`, the code that
makes the README's ``docs/plot-gpt2.png`` (here on the smaller ``cnn`` example, for
time). Skips, saying why, where no Chromium is installed
(``.ci/run`` installs Debian's ``chromium`` when it can)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autoremat.picture.browser import find_browser
from autoremat.picture.svg import STYLES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from screenshot_plot import SIZE, example_picture

pytestmark = pytest.mark.skipif(
    find_browser() is None, reason="chromium not installed: apt-get install chromium"
)


def pixels_like(png: Path, colour: str, tolerance: int = 40) -> int:
    """How many pixels of the screenshot are within ``tolerance`` (each channel) of ``colour``
    (``#rrggbb``)."""
    import numpy as np
    from PIL import Image

    want = np.array([int(colour[k : k + 2], 16) for k in (1, 3, 5)])
    image = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    return int((np.abs(image - want) <= tolerance).all(axis=-1).sum())


@pytest.mark.slow
def test_the_page_renders_its_curves_and_budget_and_logs_nothing(tmp_path):
    shot = example_picture("cnn", tmp_path, budget="60%")
    assert shot.messages == ()
    from PIL import Image

    assert Image.open(shot.png).size == SIZE
    for key in ("without", "plan", "measured", "budget"):
        assert pixels_like(shot.png, STYLES[key].colour) > 300, f"no {key} curve drawn"
    assert pixels_like(shot.png, "#ffffff", 8) < SIZE[0] * SIZE[1] * 0.97  # not blank
