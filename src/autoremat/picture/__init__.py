"""The picture of a step's memory (issue 41): :func:`autoremat.plot`
(:mod:`autoremat.picture.draw`) writes one self-contained HTML page (inline SVG) of a plan's
step with and without it, or of what :func:`autoremat.fit` tried. ``trace`` collects the
step's moments from the plan's own run; ``series``, ``svg``, ``step_figure`` and
``fit_figure`` draw (pure); ``page`` writes the page; ``browser`` photographs it in headless
Chromium."""
