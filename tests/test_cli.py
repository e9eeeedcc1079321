"""The command line: tree, plan, demo, examples, help, budgets as the CLI writes them, and
one-line errors (status 2) for bad targets, failing factories and infeasible budgets."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from autoremat.cli.arguments import loss_from_output, parse_budget_arg
from autoremat.cli.commands import main
from autoremat.cli.targets import CliError
from autoremat.core.sizes import format_size
from conftest import TINY


def test_tree_prints_paths_and_shapes(capsys):
    assert main(["tree", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert "  h.0: Block (float32[8, 128, 128]) -> (float32[8, 128, 128])" in out
    assert "*" not in out.split(":")[0]


def test_plan_marks_the_chosen_modules(capsys):
    assert main(["plan", "gpt2", "--segments", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "Plan for TinyGPT (levels, segments=3: the first level with more than 3 split points): "
        "recompute 4 modules\n  h.0\n"
    )
    assert "\n*   h.3: Block" in out


def test_factory_file_target(tmp_path, capsys):
    file = tmp_path / "my_model.py"
    file.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1))
                return model, (torch.randn(2, 4),), {}

            def bad():
                return 42
            """
        )
    )
    assert main(["plan", f"{file}:build", "--segments", "0"]) == 0
    assert "recompute 1 module\n  (root)" in capsys.readouterr().out
    assert main(["plan", f"{file}:bad"]) == 2
    assert "must return (model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nope", "unknown target 'nope'"),
        ("missing.py:f", "no such file: missing.py"),
    ],
)
def test_bad_targets_give_one_line(target, message, capsys):
    assert main(["tree", target]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_segments_is_one_line(capsys):
    assert main(["plan", "gpt2", "--segments", "-2"]) == 2
    assert (
        capsys.readouterr().err
        == "autoremat: error: --segments must be 0 or more, got -2; try --segments 3\n"
    )


@pytest.mark.slow
def test_python_dash_m_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "autoremat", "examples"], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[0].startswith("gpt2 ")
    assert "hf-llama" in done.stdout


def test_a_reader_that_leaves_gets_no_traceback():
    """``autoremat ... | head``: the reader closes the pipe before the command writes; the
    command ends with status 1 and nothing on stderr (it raised ``BrokenPipeError`` with a
    traceback, and again when Python flushed at exit)."""
    command = subprocess.Popen(
        [sys.executable, "-m", "autoremat", "tree", "gpt2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert command.stdout is not None and command.stderr is not None
    command.stdout.close()  # (before it writes: it imports torch and builds the model first)
    err = command.stderr.read().decode()
    assert command.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_plan_objective_flag(capsys):
    assert main(["plan", "gpt2", "--budget", "50%", "--objective", "flops"]) == 0
    out = capsys.readouterr().out
    assert "minimised flops" in out and "selective" in out
    assert main(["plan", "gpt2", "--segments", "2", "--objective", "flops"]) == 2
    assert "--objective applies to budget and device plans" in capsys.readouterr().err


def test_a_loss_no_step_uses_is_refused_not_ignored(capsys):
    """A ``--segments`` plan runs no step: a ``--loss`` with it was ignored, a typo too."""
    assert main(["plan", "gpt2", "--segments", "2", "--loss", "nosuch"]) == 2
    assert "--loss applies to the steps that run" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--segments", "2", "--loss", "nosuch", "--measure"]) == 2
    assert "has no 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "gpt2", "--budget", "-5%"], "budget -5% is not understood"),
        (["plan", "gpt2", "--segments", "3", "--budget", "50%"], "not allowed with argument"),
        (["plan", "gpt2", "--budget"], "expected one argument"),
        (["plan", "gpt2", "--nope"], "unrecognized arguments: --nope"),
        (["nope"], "invalid choice: 'nope'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_argument_mistakes_are_one_line_with_status_2(argv, words, capsys):
    """Argparse's own mistakes too: one line, no usage block."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error: ") and err.count("\n") == 1, err
    assert words in err and "usage:" not in err


LOSS_IN_A_TUPLE = """
import torch
from torch import nn

class WithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)))

    def forward(self, x):
        logits = self.body(x)
        return logits, logits.pow(2).mean()

def build():
    g = torch.Generator().manual_seed(0)
    return WithLoss(), (torch.randn(64, 64, generator=g),), {}
"""


def test_loss_names_the_part_of_the_output_that_is_the_loss(tmp_path, capsys):
    """``--loss`` picks the loss out of the output: a position, a key, an attribute; what is
    missing is named. A model returning (logits, loss) plans with ``--loss 1``."""
    logits, loss = torch.ones(2, 3), torch.tensor(1.5)
    assert loss_from_output(None) is None  # the default: autoremat.record.step.default_loss
    assert loss_from_output("1")((logits, loss)) is loss
    assert loss_from_output("loss")({"logits": logits, "loss": loss}) is loss
    assert loss_from_output("loss")(SimpleNamespace(loss=loss)) is loss
    with pytest.raises(CliError, match="has 2 parts; give a position below 2"):
        loss_from_output("2")((logits, loss))
    with pytest.raises(CliError, match="has no 'loss'; its keys are logits"):
        loss_from_output("loss")({"logits": logits})
    file = tmp_path / "withloss.py"
    file.write_text(LOSS_IN_A_TUPLE)
    target = f"{file}:build"
    assert main(["plan", target, "--budget", "0.8", "--objective", "flops", "--loss", "1"]) == 0
    assert capsys.readouterr().out.startswith("Plan for WithLoss (budget ")
    assert main(["plan", target, "--budget", "0.8", "--loss", "logits"]) == 2
    assert "has no 'logits'" in capsys.readouterr().err


def test_the_levels_count_says_what_it_means(capsys):
    """``segments=K`` is no number of segments: 1 and 3 give the same four blocks on this
    transformer, and the plan says why (the first level with more than K split points)."""
    assert main(["plan", "gpt2", "--segments", "1"]) == 0
    one = capsys.readouterr().out
    assert main(["plan", "gpt2", "--segments", "3"]) == 0
    three = capsys.readouterr().out
    assert "recompute 4 modules" in one and "recompute 4 modules" in three
    assert "the first level with more than 1 split point" in one


# --budget as the command line takes it ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0.5", 0.5),
        ("1", 1.0),
        (".25", 0.25),
        ("50%", "50%"),
        ("2GiB", "2GiB"),
        ("800MB", "800MB"),
        ("1.5 KiB", "1.5 KiB"),
        ("25000000", 25000000),
        ("2", 2),
    ],
)
def test_budget_forms(text, value):
    parsed = parse_budget_arg(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "nan", "inf", "150%", "0%", "50x", "MiB", ""])
def test_bad_budget_names_the_cli_forms(text):
    with pytest.raises(CliError) as caught:
        parse_budget_arg(text)
    message = str(caught.value)
    assert "50%" in message and "2GiB" in message and "0.5" in message
    assert not re.search(r"\b(int|float|str)\b", message), message


def test_plan_takes_a_fraction_and_prints_sizes(tiny, capsys):
    assert main(["plan", tiny, "--budget", "0.95", "--measure"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\nmeasured peak \d+\.\d\d KiB \(predicted \d+\.\d\d KiB, error ", out)


@pytest.mark.slow
def test_plan_takes_autocast_and_measures_under_it(capsys, tiny):
    """``--autocast bf16`` plans and measures the step as it will train (forward and loss
    under bf16 autocast): the figures ``plan(..., autocast=torch.bfloat16)`` gives."""
    import autoremat
    from autoremat.cli.targets import load_target

    assert main(["plan", tiny, "--budget", "75%", "--objective", "flops", "--measure",
                 "--autocast", "bf16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    model, args, kwargs = load_target(tiny)
    chosen = autoremat.plan(
        model, args, kwargs, budget=0.75, objective="flops", autocast=torch.bfloat16
    )
    fp32 = autoremat.plan(model, args, kwargs, budget=0.75, objective="flops")
    assert chosen.baseline_peak != fp32.baseline_peak
    assert chosen.estimated_peak is not None
    assert f"predicted peak {format_size(chosen.estimated_peak)}" in out
    assert "error +0.0%); within the budget" in out


def test_plan_saves_the_plan_it_prints_for_the_training_script(tmp_path, capsys):
    """``--save FILE.json`` writes the plan printed, which ``Plan.load`` reads back; a folder
    that does not exist is one line, status 2, before anything is planned."""
    import autoremat
    from autoremat.cli.targets import load_target

    path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--budget", "50%", "--objective", "flops",
                 "--save", str(path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"plan saved: {path}" in out
    saved = autoremat.Plan.load(path)
    model, args, kwargs = load_target("mlp")
    again = autoremat.plan(model, args, kwargs, budget=0.5, objective="flops")
    assert saved.modules == again.modules and saved.estimated_peak == again.estimated_peak
    assert saved.modules
    assert all(re.search(rf"\n  {re.escape(m)} +full ", out) for m in saved.modules)
    missing = tmp_path / "no" / "plan.json"
    assert main(["plan", "mlp", "--segments", "3", "--save", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "the folder" in err and "does not exist" in err and len(err.splitlines()) == 1


def test_bad_budget_is_one_line_in_cli_words(capsys):
    assert main(["plan", "gpt2", "--budget", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error: budget 1.5: a bare number is a fraction in (0, 1]")
    assert err.count("\n") == 1 and "float" not in err


def test_infeasible_budget_suggests_cli_syntax_that_works(tiny, capsys):
    assert main(["plan", tiny, "--budget", "1KiB"]) == 2
    err = capsys.readouterr().err
    found = re.fullmatch(
        r"autoremat: error: budget 1KiB is below the lowest peak Sequential reaches, "
        r"\d+\.\d\d KiB \(\d+% of \d+\.\d\d KiB without recompute\); "
        r"try --budget (\d+\.\d\dKiB)\n",
        err,
    )
    assert found, err
    assert "budget=" not in err
    assert main(["plan", tiny, "--budget", found.group(1)]) == 0


def test_infeasible_fraction_says_its_size(tiny, capsys):
    assert main(["plan", tiny, "--budget", "0.1"]) == 2
    assert re.match(
        r"autoremat: error: budget 0\.1 \(\d+\.\d\d KiB\) is below the lowest peak",
        capsys.readouterr().err,
    )


# Factories that fail -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "factory", "words"),
    [
        ("def build():\n    raise RuntimeError('no weights\\nhere')\n", "build",
         ["build()", "RuntimeError: no weights here"]),
        ("import not_a_module_anywhere\n", "build",
         ["importing", "build()", "ModuleNotFoundError", "not_a_module_anywhere"]),
        ("import sys\nsys.exit(3)\n", "build", ["importing", "SystemExit: 3"]),
        ("def build(size):\n    return size\n", "build", ["build()", "TypeError"]),
    ],
)  # fmt: skip
def test_failing_factory_is_one_line_with_status_2(tmp_path, capsys, source, factory, words):
    file = tmp_path / "failing.py"
    file.write_text(source)
    assert main(["tree", f"{file}:{factory}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and str(file) in err
    for word in words:
        assert word in err, (word, err)


def test_a_measured_levels_plan_says_what_it_lowers(tmp_path, capsys):
    """A levels plan predicts nothing (its split points are counted, not priced): measured,
    it is set against the step without recompute, which it may not lower (a helper's CNN)."""
    file = tmp_path / "tiny.py"
    file.write_text(
        "import torch\nfrom torch import nn\n\ndef build():\n    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Sequential(nn.Linear(256, 256), nn.ReLU()), "
        "nn.Linear(256, 1))\n    return model, (torch.randn(2, 256),), {}\n"
    )
    assert main(["plan", f"{file}:build", "--segments", "1", "--measure"]) == 0
    assert re.search(r"without recompute [\d.]+ KiB: the plan lowers nothing\)",
                     capsys.readouterr().out)  # fmt: skip
    assert main(["plan", "gpt2", "--segments", "2", "--measure"]) == 0
    assert re.search(r"\(without recompute [\d.]+ MiB: \d+% lower\)", capsys.readouterr().out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a device this torch has not")
def test_fit_on_a_device_this_torch_has_not_is_one_line(capsys):
    """Before: torch's AssertionError and its traceback, status 1 (the guide's own example)."""
    assert main(["fit", "mlp", "--device", "cuda", "--device-memory", "10MiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoremat: error: --device cuda: ") and "Traceback" not in err


def test_factory_file_may_define_dataclasses(tmp_path, capsys):
    file = tmp_path / "with_dataclass.py"
    file.write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Config:\n    width: int = 4\n"
        + TINY
    )
    assert main(["tree", f"{file}:build"]) == 0
    assert "0: Sequential" in capsys.readouterr().out


# Help ----------------------------------------------------------------------------------------


def test_help_is_plain_text_and_lists_everything(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out
    for command in ("tree", "plan", "demo", "bench", "examples"):
        assert re.search(rf"^  {command} ", out, re.MULTILINE), command
    assert "FILE.py:FACTORY" in out and "gpt2" in out
    assert "executed" in out and "trust" in out
    assert "50%" in out and "0.5" in out and "2GiB" in out


# The demo ------------------------------------------------------------------------------------


def test_demo_uses_the_lowest_budget_when_asked_for_less(tiny, capsys):
    assert main(["demo", tiny, "--budget", "1KiB", "--rounds", "0"]) == 0
    out = capsys.readouterr().out
    note = re.search(
        r"^budget 1KiB is below the lowest peak Sequential reaches, (\d+\.\d\d KiB) .*; "
        r"using (\d+\.\d\d KiB) instead$",
        out,
        re.MULTILINE,
    )
    assert note, out
    assert note.group(1) == note.group(2)
    assert f"Plan for Sequential (budget {note.group(2)})" in out
    assert "time: not measured (--rounds 0)" in out and "ms/step" not in out
    assert "loss, gradients and buffers identical" in out


@pytest.mark.slow
def test_demo_cnn_default_budget_is_met(capsys):
    """The built-in cnn cannot reach 50%: the demo says so and uses what it can reach."""
    assert main(["demo", "cnn", "--rounds", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^budget 50% \(.*\) is below the lowest peak ConvNet reaches", out, re.M)
    assert "identical" in out


def test_demo_states_the_timing_noise(tiny, capsys):
    """Only the format, and that the time ratios are those of the ms/step column (as printed,
    within its rounding): the figures are whatever the machine gave."""
    assert main(["demo", tiny, "--budget", "0.99", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "Plan for Sequential (budget " in out and "using" not in out
    header = next(line for line in out.splitlines() if "ms/step" in line)
    assert header.split() == ["peak", "predicted", "held", "GFLOP", "ms/step", "spread"]
    rows = out.split(header + "\n")[1].splitlines()[:3]
    size = r"\d+\.\d\d [KMG]iB"
    ms = []
    for row in rows:
        found = re.fullmatch(rf".{{18}} +{size} +({size}|-) +{size} +[\d.]+ +([\d.]+) +\d+%", row)
        assert found, row
        ms.append(float(found.group(2)))
    ratios = [line for line in out.splitlines() if ": peak x" in line]
    assert len(ratios) == 2
    for line, step in zip(ratios, ms[1:], strict=True):
        found = re.search(r", FLOPs x\d+\.\d\d, time x(\d+\.\d\d)$", line)
        assert found, line
        low, high = (step - 0.005) / (ms[0] + 0.005), (step + 0.005) / (ms[0] - 0.005)
        assert low - 0.005 <= float(found.group(1)) <= high + 0.005, (line, ms)
    assert "median of 3 rounds" in out and "CPU step times are noisy" in out


def test_the_console_script_names_the_command():
    """``pyproject.toml``'s ``autoremat`` script resolves to the command's ``main``."""
    import importlib
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    module, _, name = project["project"]["scripts"]["autoremat"].partition(":")
    assert getattr(importlib.import_module(module), name) is main
