"""One way in: ``plan`` answers a budget, a device's memory (per rank too), segments and
compile; the package imports lightly; what a plan does worse than the model as given is said
once."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cli.commands import main
from autoremat.wrap import calls
from conftest import tiny_llama


def test_the_package_imports_neither_dynamo_nor_fsdp():
    """``import autoremat`` adds little to ``import torch`` (0.13 s after it, measured; the
    dynamo and FSDP imports it dropped cost 1.3 s): it imports neither, which a model that is
    compiled or sharded has imported already."""
    code = (
        "import sys, autoremat; "
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp', 'sympy') "
        "if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)  # fmt: skip
    assert done.stdout.strip() == "[]", done.stdout


def test_the_untraced_counters_are_marked_as_dynamo_marks_them():
    """The call counters dynamo runs when tracing are marked as
    ``torch._dynamo.assume_constant_result`` marks a function (without importing dynamo)."""
    import torch._dynamo

    def f() -> int:
        return 0

    marked = torch._dynamo.assume_constant_result(f)
    names = {n for n in vars(marked) if "dynamo" in n}
    for fn in (calls._advance_untraced, calls._new_step_untraced):
        assert {n: getattr(fn, n) for n in names} == {n: getattr(marked, n) for n in names}


def test_the_public_names_are_few_and_each_is_called_constructed_or_caught():
    assert len(autoremat.__all__) <= 20
    for name in autoremat.__all__:
        value = getattr(autoremat, name)
        assert callable(value), name
    for gone in ("plan_for_device", "plan_for_compile", "predict_training", "Node", "Choice"):
        assert not hasattr(autoremat, gone), gone


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_device_plan_is_plan_with_device_memory():
    """``plan(device_memory=...)`` fits the whole step (optimizer included) and says so by its
    estimate; a budget plan is the same function with ``budget=``."""
    model, x = Blocks(), torch.randn(64, 32)
    whole = autoremat.predict_memory(model, (x,), optimizer="sgd").tensors
    roomy = autoremat.plan(model, (x,), device_memory=2 * whole, optimizer="sgd")
    assert roomy.modules == ()
    tight = autoremat.plan(model, (x,), device_memory=whole - 1, optimizer="sgd")
    assert tight.modules
    assert autoremat.predict_memory(model, (x,), plan=tight, optimizer="sgd").tensors < whole


def test_segments_zero_says_it_recomputes_the_whole_model_once(caplog):
    """``segments=0`` (claim 3: the root alone) plans the whole model, which saves nothing: one
    warning says so and what to do; the command line prints it once."""
    model, x = Blocks(), torch.randn(64, 32)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        made = autoremat.plan(model, (x,), segments=0)
    assert made.modules == ("",) and "whole_model" in made.warnings
    said = [r for r in caplog.records if "recomputes the whole Blocks" in r.getMessage()]
    assert len(said) == 1 and "use segments=1 or more" in said[0].getMessage()
    assert "whole_model" not in autoremat.plan(model, (x,), segments=1).warnings
    flat = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    said = autoremat.plan(flat, (x,), segments=5).warnings["whole_model"]  # (no count splits it)
    assert "its children are all leaves" in said and "budget=" in said and "segments=" not in (
        said.split("takes longer;")[1]
    )


def test_the_command_line_says_segments_zero_saves_nothing(capsys):
    assert main(["plan", "mlp", "--segments", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("recomputes the whole") == 1 and "segments=1 or more" in err


def test_a_plan_that_keeps_more_than_the_models_own_checkpointing_says_so():
    """A model that checkpoints itself: a budget in % is of its peak with that off, so a plan
    can keep more than the model as given; the plan says so (the model's own peak, the fix),
    and a budget at that peak gives a plan that does not."""
    model, ids = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"input_ids": ids, "labels": ids}
    on = [p for p, m in model.named_modules() if vars(m).get("gradient_checkpointing") is True]
    assert on
    loose = autoremat.plan(model, (), kwargs, budget="95%", loss_fn=lambda out: out.loss)
    assert "own_checkpointing" in loose.warnings
    text = loose.warnings["own_checkpointing"]
    assert "LlamaForCausalLM checkpoints itself" in text and "budget=" in text
    own = int(text.split("budget=")[1].split(" ")[0])
    assert loose.estimated_peak is not None and loose.estimated_peak > own
    assert on == [p for p, m in model.named_modules() if vars(m).get("gradient_checkpointing")]
    tight = autoremat.plan(model, (), kwargs, budget=own, loss_fn=lambda out: out.loss)
    assert "own_checkpointing" not in tight.warnings
    assert tight.estimated_peak is not None and tight.estimated_peak <= own


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--sharding", "fsdp2"], "--sharding fsdp2 needs --world-size N"),
        (["--world-size", "2"], "--world-size sizes one rank of a job: add --sharding"),
        (["--sharding", "ddp", "--world-size", "2", "--fsdp-units", "h.0"], "FSDP2's"),
    ],
)
def test_the_fit_command_refuses_half_a_sharding_in_one_line(argv, says, capsys):
    assert main(["fit", "mlp", "--device-memory", "64MiB", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1


def test_the_plan_command_plans_for_a_device_too(capsys):
    """``autoremat plan TARGET --device-memory M`` is ``plan(device_memory=M)``: its summary,
    status 0; a device too small is the memory it needs, a part a line, status 2; the
    optimizer or a sharding without a device is one line."""
    assert main(["plan", "mlp", "--device-memory", "40MiB", "--optimizer", "sgd"]) == 0
    assert "Plan for Sequential" in capsys.readouterr().out
    assert main(["plan", "mlp", "--device-memory", "5MiB"]) == 2
    err = capsys.readouterr().err
    assert "does not fit 5.00 MiB" in err and "optimizer state" in err.splitlines()[3]
    assert main(["plan", "mlp", "--budget", "50%", "--sharding", "ddp", "--world-size", "2"]) == 2
    assert "add --device-memory" in capsys.readouterr().err
