"""What a new user met on a first use: output nobody asked for, a note given twice, errors hard
to read or pointing the wrong way. Each test fails without its fix; all use tiny models."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoremat
from autoremat.cli.commands import main
from autoremat.core import huggingface
from autoremat.planning.strategies.budget import BudgetTooLow
from autoremat.record.memory import CpuAllocatorMemory
from autoremat.training.sharding import Sharding


def _mlp(width: int = 32, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


# --- 1. the profiler's session markers --------------------------------------------------------


def test_counting_the_cpu_allocator_prints_no_profiler_markers(capfd: Any) -> None:
    """kineto writes ``USDT: ... profiler_start`` / ``profiler_stop`` to file descriptor 2 as
    each profiler session starts and stops; autoremat's own sessions keep them off the screen,
    and what the caller's code writes inside the block still comes, in order."""
    sys.stderr.flush()
    os.write(2, b"before\n")
    with CpuAllocatorMemory() as memory:
        os.write(2, b"inside\n")
        torch.ones(1000).sum()
    os.write(2, b"after\n")
    assert memory.peak > 0
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err, err
    assert err.splitlines() == ["before", "inside", "after"]


def test_fit_on_the_cpu_prints_nothing_of_the_profiler(capfd: Any) -> None:
    model = _mlp()
    found = autoremat.fit(model, lambda b: ((torch.randn(b, 32),), {}), device_memory="2MiB",
                          max_batch=64)  # fmt: skip
    assert found.fits  # (checked by the CPU allocator: the profiler ran)
    assert "USDT" not in capfd.readouterr().err


# --- 2. the use_cache note, once ---------------------------------------------------------------


def _causal_lm(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
            eos_token_id=0))  # fmt: skip
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "budget"),
    [("gpt2", "100%"), ("llama", "70%")],
    ids=["gpt2-no-recompute", "llama-recompute"],
)
def test_the_trainer_gives_the_use_cache_note_once_per_run(
    kind: str, budget: str, tmp_path: Path, caplog: Any, monkeypatch: Any
) -> None:
    """The note names the model the Trainer calls (``...ForCausalLM``), once: not again for
    the base model inside it, and not used up by the plan's rehearsal on a shadow (where it
    is kept quiet), with or without recompute."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from autoremat.integrations.huggingface_trainer import AutoRematCallback

    monkeypatch.setattr(huggingface, "_warned", set())  # (once per process: a fresh process)
    model = _causal_lm(kind)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, logging_strategy="no",
    )  # fmt: skip
    callback = AutoRematCallback(budget=budget)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[callback])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        trainer.train()
    assert callback.plan is not None
    notes = [r.getMessage() for r in caplog.records if "use_cache=False" in r.getMessage()]
    assert len(notes) == 1, notes
    assert notes[0].startswith(type(model).__name__ + " "), notes


# --- 3. fit's "does not fit" breakdown, a part a line ------------------------------------------


BREAKDOWN = ("parameters", "buffers", "optimizer state", "inputs", "step peak",
             "or gradients + optimizer step", "tensors at most")  # fmt: skip


def _parts(lines: list[str]) -> list[str]:
    """The lines of the breakdown (indented), by the part each starts with."""
    found = [line.strip() for line in lines if line.startswith("  ")]
    return [next(p for p in BREAKDOWN if line.startswith(p)) for line in found]


def test_fit_that_cannot_fit_batch_one_raises_budget_too_low_a_part_a_line() -> None:
    model = _mlp(width=256)  # (1 MiB of parameters alone)
    with pytest.raises(BudgetTooLow) as info:
        autoremat.fit(model, lambda b: ((torch.randn(b, 256),), {}), device_memory="1MiB")
    lines = str(info.value).splitlines()
    assert lines[0].startswith("even a batch of 1 does not fit 1.00 MiB")
    assert _parts(lines) == list(BREAKDOWN)
    assert lines[-1].startswith("Use a device with more memory")
    assert 0 < info.value.lowest <= info.value.baseline


def test_the_fit_command_shows_the_breakdown_a_part_a_line(capsys: Any) -> None:
    assert main(["fit", "mlp", "--device-memory", "1MiB"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0].startswith("autoremat: error: even a batch of 1 does not fit"), err
    assert _parts(lines) == list(BREAKDOWN), err
    assert lines[-1].startswith("Use a device with more memory"), err
    assert "Traceback" not in err


# --- 4. Lightning: the message, not the training loop's traceback --------------------------------


def test_a_budget_lightning_cannot_reach_raises_the_message_alone() -> None:
    """A step that cannot run on ``meta`` (it reads a value) is planned for real; its
    :class:`BudgetTooLow` reaches the user without the meta failure chained to it and without
    the frames of Lightning's loop and of the planner (the test's call, ``Trainer.fit``)."""
    pl = pytest.importorskip("pytorch_lightning")
    from autoremat.integrations.lightning_callback import AutoRematLightning

    class Net(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.net(x)
            return y * 2 if y.sum().item() > 0 else y  # (a value read: no meta profile)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 32, generator=g),
                                          torch.randn(32, 1, generator=g))  # fmt: skip
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[AutoRematLightning(budget="1KiB")])  # fmt: skip
    with pytest.raises(BudgetTooLow, match="is below the lowest peak") as info:
        trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=16))
    assert info.value.__cause__ is None and info.value.__context__ is None
    frames = traceback.extract_tb(info.value.__traceback__)
    assert len(frames) <= 3, [f"{f.filename}:{f.name}" for f in frames]


# --- 5. per rank: units FSDP2 refuses ----------------------------------------------------------


def _tied_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def _tokens(batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    x = torch.randint(0, 64, (batch, 16), generator=torch.Generator().manual_seed(0))
    return (), {"input_ids": x, "labels": x}


@pytest.mark.parametrize(
    ("units", "said"),
    [
        (["model.embed_tokens", "lm_head"],
         ["FSDP2 refused the units model.embed_tokens, lm_head of LlamaForCausalLM",
          "Parameter 'lm_head.weight' is shared"]),
        (["model.layers"],
         ["FSDP2 refused the unit model.layers of LlamaForCausalLM",
          "containers that do not implement forward: ModuleList)"]),
    ],
    ids=["tied-weights-split", "container"],
)  # fmt: skip
def test_units_fsdp2_refuses_are_named_with_its_reason_and_the_fix(
    units: list[str], said: list[str]
) -> None:
    model = _tied_llama()
    sharding = Sharding("fsdp2", world_size=2, units=units)
    with pytest.raises(ValueError) as info:
        autoremat.fit(model, _tokens, device_memory="64MiB", sharding=sharding, max_batch=4)
    message = str(info.value)
    for words in [*said, "Choose other units", "units=None: model.layers.0, model.layers.1"]:
        assert words in message, message
    assert "real device" not in message and "reads values" not in message
    assert "\n" not in message  # (FSDP2's own message carries the module's repr)


def test_a_unit_whose_forward_never_runs_is_named_as_refused() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return nn.functional.linear(x, self.head.weight)  # (head's forward never runs)

    sharding = Sharding("fsdp2", world_size=2, units=["head"])
    with pytest.raises(ValueError, match="FSDP2 refused the unit head of Head: a unit's") as info:
        autoremat.fit(Head(), lambda b: ((torch.randn(b, 8),), {}), device_memory="1MiB",
                      sharding=sharding, max_batch=4)  # fmt: skip
    assert "units=None: blocks.0, blocks.1" in str(info.value)
