"""Starting test workers as ranks: ``world`` processes of a script, each told its rank.

Each process runs ``python SCRIPT *argv(rank)`` with ``env(rank)`` added to the environment
(one thread each), writes its log to ``out/log<rank>.txt`` and its results to
``out/rank<rank>.json``. A launch that takes longer than ``timeout`` seconds (a hang in a
collective) is killed; a failed or killed rank fails the test with every rank's log tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest


def run_ranks(script: str, world: int, out: Path, argv: Callable[[int], list[str]],
              env: Callable[[int], dict[str, str]] = lambda r: {},
              timeout: float = 600) -> list[Any]:  # fmt: skip
    """Run the ranks (module docstring); each rank's JSON results, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    logs = [open(out / f"log{r}.txt", "w") for r in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen([sys.executable, script, *argv(r)], stdout=log, stderr=log,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env(r)})
        for r, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    if any(p.returncode != 0 for p in procs):
        text = "\n".join((out / f"log{r}.txt").read_text()[-3000:] for r in range(world))
        pytest.fail(f"a rank failed or hung\n{text}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def worker_main(run: Callable[[], None]) -> NoReturn:
    """Run one rank's work in a process :func:`run_ranks` started, then exit at once: 1 with
    the traceback printed on an error (the other ranks' collectives then fail instead of
    waiting), 0 after it, without interpreter teardown (a trainer's or gloo's threads may
    abort it)."""
    from conftest import no_recompute_if_asked

    no_recompute_if_asked()
    code = 0
    try:
        run()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
