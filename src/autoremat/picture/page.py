"""The picture's HTML page: one self-contained file (inline SVG and a few lines of CSS; no
script, no network), readable in any browser and printable."""

from __future__ import annotations

import os
from collections.abc import Sequence
from html import escape
from pathlib import Path

__all__ = ["CSS", "page", "writable", "write_page"]

CSS = (
    "body{font-family:DejaVu Sans,Helvetica,Arial,sans-serif;margin:16px 24px;color:#222;"
    "background:#fff}h1{font-size:20px;margin:0 0 6px}h2{font-size:16px;margin:18px 0 4px}"
    "p,li{font-size:13px;margin:2px 0;max-width:1180px}ul{padding-left:18px;margin:4px 0}"
    "code{font-size:12px}.note{color:#8a2b00}svg{display:block;margin:8px 0}"
)


def page(title: str, sections: Sequence[tuple[str, Sequence[str], str]],
         notes: Sequence[str] = ()) -> str:  # fmt: skip
    """The page: a ``title``, then each section's heading, its lines (escaped) and its figure
    (an ``<svg>``, as it is); ``notes`` (escaped) last, marked."""
    body = [f"<h1>{escape(title)}</h1>"]
    for heading, lines, figure in sections:
        body.append(f"<h2>{escape(heading)}</h2>")
        body += [f"<p>{escape(line)}</p>" for line in lines]
        body.append(figure)
    if notes:
        body.append('<ul class="note">' + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def writable(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`Path`, once its folder is known to exist.

    Raises:
        ValueError: the folder does not exist (the message names it).
    """
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"cannot write {target}: the folder {target.parent} does not exist; "
                         f"create it or give another path")  # fmt: skip
    return target


def write_page(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (its folder must exist: :func:`writable`), return the path."""
    target = writable(path)
    target.write_text(text, encoding="utf-8")
    return target
