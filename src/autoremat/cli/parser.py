"""The ``autoremat`` command's arguments: its subcommands, their options and its help text.

A mistake in them is one line, ``autoremat: error: ...``, with exit status 2, as every other
error of the command (:class:`Parser` raises :class:`~autoremat.cli.targets.CliError` instead
of printing argparse's usage block)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from autoremat.cli.arguments import AUTOCAST, LOSS_HELP
from autoremat.cli.demo import DEFAULT_ROUNDS
from autoremat.cli.targets import CliError
from autoremat.core.sizes import BUDGET_FORMS
from autoremat.examples import EXAMPLES
from autoremat.planning.choice import OBJECTIVES
from autoremat.planning.strategies.levels import DEFAULT_SEGMENTS
from autoremat.training.fit import FIT_OBJECTIVES
from autoremat.training.optimizer_memory import OPTIMIZERS
from autoremat.training.sharding import SHARDINGS

__all__ = ["DESCRIPTION", "EPILOG", "VALUE_OPTIONS", "Parser", "parser"]

DESCRIPTION = """\
Choose which submodules of a PyTorch model to recompute in the backward pass (activation
checkpointing), to lower the peak memory of a training step."""

EPILOG = f"""\
subcommands:
  tree TARGET       print the modules that ran, with their paths and input/output shapes
  plan TARGET       print the modules chosen for recompute: --segments K (the levels
                    strategy: the module tree walked level by level until more than K
                    split points are found, default K={DEFAULT_SEGMENTS}) or --budget B (the
                    cheapest recompute whose predicted peak fits B); --measure applies the
                    plan to a copy and measures its peak; --plot FILE.html draws the step
                    with and without the plan (one HTML file, no network)
  demo [TARGET]     plan with both strategies, apply them, measure peak, FLOPs and step
                    time, and check that a training step is unchanged (TARGET: gpt2)
  bench TARGET      compare ways to recompute side by side (a markdown table)
  fit TARGET        the largest batch whose training step (parameters, gradients,
                    optimizer state, activations) fits --device-memory M (24GiB, 90%),
                    and the cheapest plan for it, checked once on the device (--plot
                    FILE.html: the step by part at each batch tried)
  examples          list the built-in example models

TARGET is one of:
  NAME              a built-in example ({", ".join(EXAMPLES)};
                    "autoremat examples" describes them)
  FILE.py:FACTORY   a Python file and a function in it that takes no arguments and returns
                    (model, args, kwargs): an nn.Module, a tuple of positional inputs and a
                    dict of keyword inputs for one forward pass

A TARGET file is executed: it is imported as Python code, with your permissions. Only run
files you trust.

B, a budget for the peak memory of a training step, is {BUDGET_FORMS}.

The loss of a training step (--loss) is the model output's loss when it has one, else the
sum of every floating-point tensor in the output: name it when the output holds more.

Errors print one line, "autoremat: error: ...", and exit with status 2."""

TARGET_HELP = "a built-in example name, or FILE.py:FACTORY (the file is executed)"
# The options that take a value (autoremat.cli.arguments.joined_values joins a value that
# starts with "-" to them, so that "--budget -5%" is refused in the option's own words).
VALUE_OPTIONS = (
    "--autocast", "--batch-dim", "--budget", "--device", "--device-memory", "--loss",
    "--max-batch", "--objective", "--optimizer", "--plot", "--repeats", "--rounds", "--segments",
    "--fsdp-units", "--sharding", "--world-size",
)  # fmt: skip


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are a :class:`CliError` (one line, status 2), not
    argparse's usage block; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def parser() -> Parser:
    """The parser of the ``autoremat`` command."""
    top = Parser(
        prog="autoremat",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_tree = sub.add_parser("tree", help="print the module tree with paths and I/O shapes")
    p_tree.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    _add_plan(sub.add_parser("plan", help="print the modules chosen for recompute"))
    _add_demo(
        sub.add_parser(
            "demo", help="plan, apply, check gradients and show the savings and step times"
        )
    )
    p_bench = sub.add_parser("bench", help="compare ways to recompute side by side")
    p_bench.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p_bench.add_argument("--repeats", type=int, default=3, help="timed steps per contender")
    p_bench.add_argument(
        "--compile", action="store_true", help="also torch.compile at memory budgets (slow)"
    )
    p_bench.add_argument("--loss", metavar="WHERE", help=LOSS_HELP)
    _add_fit(sub.add_parser("fit", help="the largest batch that fits a device, and its plan"))
    sub.add_parser("examples", help="list the built-in example models")
    return top


def _add_plan(p_plan: argparse.ArgumentParser) -> None:
    p_plan.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    how = p_plan.add_mutually_exclusive_group()
    how.add_argument(
        "--segments",
        type=int,
        metavar="K",
        help="levels strategy: walk the module tree level by level until more than K split "
        f"points are found (default {DEFAULT_SEGMENTS})",
    )
    how.add_argument(
        "--budget",
        metavar="B",
        help=f"budget strategy: the step's peak memory within B, {BUDGET_FORMS}".replace("%", "%%"),
    )
    how.add_argument(
        "--device-memory",
        metavar="M",
        help="the whole training step at this batch fits M (a size, whole bytes, or a "
        "percentage of the device's memory), the optimizer's state included",
    )
    p_plan.add_argument(
        "--optimizer", choices=(*OPTIMIZERS, "none"), default=None,
        help="with --device-memory: the optimizer whose state counts (default adamw)",
    )  # fmt: skip
    _add_ranks(p_plan)
    p_plan.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="time",
        help="what a budget or device plan minimises: the recompute's profiled time (default) "
        "or its FLOPs",
    )
    p_plan.add_argument(
        "--measure", action="store_true", help="apply the plan to a copy and measure its peak"
    )
    p_plan.add_argument("--loss", metavar="WHERE", help=LOSS_HELP)
    _add_plot(p_plan, "draw the step's live memory with and without the plan, its peaks, the "
              "budget and the recomputes (with --measure, the measured step too)")
    _add_autocast(p_plan, "profile and measure the step with forward and loss under "
                  "torch.autocast with this dtype, as it will train")  # fmt: skip


def _add_plot(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--plot", metavar="FILE.html", default=None,
                   help=f"{help}: one self-contained HTML file (inline SVG)")  # fmt: skip
    p.add_argument("--save", metavar="FILE.json", default=None,
                   help="write the plan to FILE.json, for autoremat.Plan.load(FILE.json)"
                   ".apply(model) in the training script")  # fmt: skip


def _add_autocast(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--autocast", choices=tuple(AUTOCAST), default=None, help=help)


def _add_demo(p_demo: argparse.ArgumentParser) -> None:
    p_demo.add_argument(
        "target",
        metavar="TARGET",
        nargs="?",
        default="gpt2",
        help="a built-in example name (default gpt2), or FILE.py:FACTORY (the file is executed)",
    )
    p_demo.add_argument(
        "--segments",
        type=int,
        default=DEFAULT_SEGMENTS,
        metavar="K",
        help="the levels plan stops at the first level with more than K split points "
        f"(default {DEFAULT_SEGMENTS})",
    )
    p_demo.add_argument(
        "--budget",
        default="50%",
        metavar="B",
        help="budget of the budget plan (default 50%%); below the lowest reachable peak, "
        "that peak is used instead",
    )
    p_demo.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        metavar="N",
        help=f"timed rounds, one step of each model per round (default {DEFAULT_ROUNDS}; "
        "0: no timing)",
    )
    p_demo.add_argument("--loss", metavar="WHERE", help=LOSS_HELP)


def _add_fit(p_fit: argparse.ArgumentParser) -> None:
    p_fit.add_argument("target", metavar="TARGET", help=TARGET_HELP)
    p_fit.add_argument(
        "--device-memory",
        metavar="M",
        default="90%",
        help="memory the whole training step may use: a size (24GiB), whole bytes, or a "
        "percentage of the device's memory, on the CPU of the RAM available now (default 90%%)",
    )
    p_fit.add_argument(
        "--device", default=None, help="move the model there first (e.g. cuda; default: as built)"
    )
    p_fit.add_argument("--optimizer", choices=(*OPTIMIZERS, "none"), default="adamw")
    p_fit.add_argument(
        "--objective",
        choices=FIT_OBJECTIVES,
        default="batch",
        help="the largest batch (default), or the most predicted samples per second",
    )
    p_fit.add_argument("--max-batch", type=int, default=2**16, metavar="N")
    p_fit.add_argument(
        "--reserve",
        metavar="M",
        default="0",
        help="memory the step leaves free (a size, 1GiB): for a loop that keeps the last output "
        "alive through the next forward, or another process (default 0)",
    )
    _add_autocast(p_fit, "train under torch.autocast with this dtype (sized on meta, casts too)")
    p_fit.add_argument(
        "--batch-dim",
        type=int,
        default=0,
        metavar="D",
        help="the inputs' batch dimension (default 0; 1 for sequence-first inputs)",
    )
    p_fit.add_argument(
        "--no-verify", action="store_true", help="do not run the batch found on the device"
    )
    p_fit.add_argument("--loss", metavar="WHERE", help=LOSS_HELP)
    _add_plot(p_fit, "draw the whole step's memory by part at each batch tried, against the "
              "device's, the chosen batch marked")
    _add_ranks(p_fit)


def _add_ranks(p_fit: argparse.ArgumentParser) -> None:
    """``fit``'s and ``plan``'s options for one rank of a job: --world-size, --sharding,
    --fsdp-units."""
    p_fit.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="size one rank of an N-rank job (with --sharding; --device-memory is one rank's)",
    )
    p_fit.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default=None,
        help="how the ranks share the model: ddp, or fsdp2 (fully_shard per block and the "
        "root); needs --world-size",
    )
    p_fit.add_argument(
        "--fsdp-units",
        metavar="PATHS",
        default=None,
        help="fsdp2: the modules fully_shard is called on, comma-separated paths (default: the "
        "model's blocks)",
    )
