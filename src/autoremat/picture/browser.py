"""A picture's page in a headless browser: a screenshot, and what the page logged.

Chromium (Debian's ``chromium``; ``chromium-browser`` or ``google-chrome`` too) renders the
page to a PNG (:func:`screenshot`); its log on stderr (``--enable-logging=stderr``) carries the
page's console messages as ``CONSOLE`` lines naming their source. Chromium's own startup noise
(no D-Bus, no GPU, the sandbox, Vulkan) names no page and is not the page's: only console lines
whose source is the page count (:func:`page_messages`). The page has no script, so any message
of its own is an error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BROWSERS", "Shot", "find_browser", "page_messages", "screenshot"]

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@dataclass(frozen=True)
class Shot:
    """A screenshot taken: the ``png`` written, the browser's ``log`` (its stderr) and the
    page's own console messages (``messages``)."""

    png: Path
    log: str
    messages: tuple[str, ...]


def find_browser() -> str | None:
    """The first of :data:`BROWSERS` on ``PATH`` (its path), or ``None``."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def page_messages(log: str, url: str) -> tuple[str, ...]:
    """The lines of a Chromium ``log`` that are the page's console messages: ``CONSOLE``
    lines whose source is ``url``, and uncaught errors."""
    return tuple(
        line.strip()
        for line in log.splitlines()
        if ("CONSOLE" in line and url in line) or "Uncaught" in line
    )


def screenshot(html: str | os.PathLike[str], png: str | os.PathLike[str],
               size: tuple[int, int] = (1280, 760), timeout: float = 60.0) -> Shot:  # fmt: skip
    """Render ``html`` (a file) in headless Chromium at ``size`` (pixels) to ``png``.

    Raises:
        FileNotFoundError: no browser on ``PATH`` (the message says how to install one).
        RuntimeError: the browser failed or wrote no PNG (the message has its log's end).
    """
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError(
            "chromium not installed: apt-get install chromium (or put chromium-browser or "
            "google-chrome on PATH)"
        )
    url, target = Path(html).resolve().as_uri(), Path(png).resolve()
    target.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        command = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}", f"--screenshot={target}",
            "--enable-logging=stderr", "--v=0", url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
    log = done.stderr + done.stdout
    if done.returncode != 0 or not target.is_file():
        tail = "\n".join(log.splitlines()[-8:])
        raise RuntimeError(f"{browser} wrote no screenshot (status {done.returncode}):\n{tail}")
    return Shot(target, log, page_messages(log, url))
