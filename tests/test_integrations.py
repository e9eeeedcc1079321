"""Where users train (issue 25): the Hugging Face ``Trainer`` callback, the Lightning callback
and the accelerate recipe each train a tiny model exactly as without them (same seeds, dropout
on: equal losses, gradients and weights), at a lower measured peak (by the CPU allocator)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

import autoremat
from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.record.memory import CpuAllocatorMemory

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _gpt2() -> Any:
    """A tiny GPT-2 with dropout on (transformers' own model, random weights)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _rows(count: int = 16, length: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (count, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class _Recorded(transformers.Trainer):  # type: ignore[misc]
    """A Trainer that keeps each step's loss and, before each optimizer step, the gradients."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.losses: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    def training_step(self, *a: Any, **k: Any) -> torch.Tensor:
        loss = super().training_step(*a, **k)
        self.losses.append(loss.detach().clone())
        self.grads.append([p.grad.clone() for p in self.model.parameters() if p.grad is not None])
        return loss


Trained = tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]


def _assert_trained_alike(plain: Trained, planned: Trained) -> None:
    """Three steps each, and bitwise the same losses, gradients at every step and weights
    after (``(losses, gradients, weights)``)."""
    assert len(plain[0]) == len(planned[0]) == 3
    assert all(torch.equal(a, b) for a, b in zip(plain[0], planned[0], strict=True))
    for mine, theirs in zip(plain[1], planned[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain[2], planned[2], strict=True))


def _train(
    tmp: Path, callbacks: list[Any], watch: Any = None, **extra: Any
) -> tuple[_Recorded, int]:
    """Three steps of the Trainer on a fresh tiny GPT-2; the CPU allocator's peak over them
    (the tracker would count the plan's meta profile too), or nothing measured under ``watch``."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
        seed=0, report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **extra,
    )  # fmt: skip
    trainer = _Recorded(model=_gpt2(), args=args, train_dataset=_rows(), callbacks=callbacks)
    memory = CpuAllocatorMemory()
    with memory if watch is None else watch:
        trainer.train()
    return trainer, memory.peak


def test_the_trainer_callback_trains_exactly_as_without_it_at_a_lower_peak(
    tmp_path: Path, capsys: Any
) -> None:
    from autoremat.integrations.huggingface_trainer import AutoRematCallback

    plain, plain_peak = _train(tmp_path / "plain", [])
    callback = AutoRematCallback(budget="50%", objective="flops")
    planned, planned_peak = _train(tmp_path / "planned", [callback])
    assert callback.plan is not None and callback.plan.modules
    assert "autoremat: Plan for GPT2LMHeadModel" in capsys.readouterr().out
    _assert_trained_alike(
        (plain.losses, plain.grads, list(plain.model.state_dict().values())),
        (planned.losses, planned.grads, list(planned.model.state_dict().values())),
    )
    assert planned_peak < 0.8 * plain_peak, (planned_peak, plain_peak)  # (recomputed)
    assert not autoremat.wrap.wrapped_paths(planned.model)  # taken off when training ended
    callback.on_train_begin(planned.args, planned.state, planned.control, model=planned.model)
    assert autoremat.wrap.wrapped_paths(planned.model)  # a later train() gets the same plan
    callback.on_train_end(planned.args, planned.state, planned.control, model=planned.model)


def test_the_trainer_saves_the_original_architecture_with_the_plan_applied(
    tmp_path: Path,
) -> None:
    from autoremat.integrations.huggingface_trainer import AutoRematCallback

    callback = AutoRematCallback(budget="50%", objective="flops", remove=False)
    with RecomputeCounter() as seen:
        trainer, _ = _train(tmp_path / "run", [callback], watch=contextlib.nullcontext())
    assert callback.plan is not None
    seen.check(callback.plan.modules)  # every entry ran ops in a recompute
    assert autoremat.wrap.wrapped_paths(trainer.model)  # still applied
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert loaded.config.architectures == ["GPT2LMHeadModel"]
    mine = trainer.model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())


def test_the_trainers_own_checkpointing_with_the_callback_is_refused_by_name(
    tmp_path: Path,
) -> None:
    from autoremat.integrations.huggingface_trainer import AutoRematCallback

    with pytest.raises(ValueError, match="would both recompute: set it to False"):
        _train(tmp_path, [AutoRematCallback(budget="50%")], gradient_checkpointing=True)
    with pytest.raises(ValueError, match="give one of budget="):
        AutoRematCallback()


# --- Lightning ------------------------------------------------------------------------------


def _lightning_run(callbacks: list[Any]) -> tuple[Any, int]:
    """Three steps of a Lightning Trainer on a fresh MLP with dropout (seed 0); the module
    (with its losses and gradients) and the CPU allocator's peak over the fit."""
    pl = pytest.importorskip("pytorch_lightning")
    from torch import nn

    class Net(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(6):
                layers += [nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1)]
            self.net = nn.Sequential(*layers, nn.Linear(256, 1))
            self.losses: list[torch.Tensor] = []
            self.grads: list[list[torch.Tensor]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("loss", loss)
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads.append([p.grad.clone() for p in self.parameters()])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    module = Net()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(3 * 512, 256, generator=g),
                                          torch.randn(3 * 512, 1, generator=g))  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=512)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    with CpuAllocatorMemory() as memory:
        trainer.fit(module, loader)
    return module, memory.peak


def test_the_lightning_callback_trains_exactly_as_without_it_at_a_lower_peak(capsys: Any) -> None:
    pytest.importorskip("pytorch_lightning")
    from autoremat.integrations.lightning_callback import AutoRematLightning

    plain, plain_peak = _lightning_run([])
    callback = AutoRematLightning(budget="50%", objective="flops")
    planned, planned_peak = _lightning_run([callback])
    assert callback.plan is not None and callback.plan.modules
    assert "autoremat: Plan for Net" in capsys.readouterr().out
    _assert_trained_alike(
        (plain.losses, plain.grads, list(plain.parameters())),
        (planned.losses, planned.grads, list(planned.parameters())),
    )
    assert planned_peak < 0.8 * plain_peak, (planned_peak, plain_peak)  # (recomputed)
    assert not autoremat.wrap.wrapped_paths(planned)  # taken off when training ended


# --- accelerate -----------------------------------------------------------------------------


def _accelerate_run(planned: bool, mixed_precision: str = "no") -> tuple[list[Any], Any, int]:
    """The recipe of docs/scale.md: plan on one batch, apply, then ``accelerator.prepare``,
    and train three steps; the losses, gradients, model and the CPU allocator's peak."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # (one process, several configurations)
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = _gpt2()
    rows = _rows(12)
    batch = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    if planned:
        autocast = torch.bfloat16 if mixed_precision == "bf16" else None
        plan = autoremat.plan(model, kwargs=batch, budget="50%", objective="flops",
                              autocast=autocast)  # fmt: skip
        assert plan.modules
        plan.apply(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[Any] = []
    torch.manual_seed(0)
    with CpuAllocatorMemory() as memory:
        for step in loader:
            loss = model(**step).loss
            accelerator.backward(loss)
            seen.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    AcceleratorState._reset_state(True)
    return seen, accelerator.unwrap_model(model), memory.peak


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_a_plan_applied_before_accelerate_prepare_trains_exactly_at_a_lower_peak(
    mixed_precision: str,
) -> None:
    plain, plain_model, plain_peak = _accelerate_run(False, mixed_precision)
    planned, planned_model, planned_peak = _accelerate_run(True, mixed_precision)
    _assert_trained_alike(
        ([loss for loss, _ in plain], [g for _, g in plain], list(plain_model.parameters())),
        ([loss for loss, _ in planned], [g for _, g in planned], list(planned_model.parameters())),
    )
    assert autoremat.wrap.wrapped_paths(planned_model)  # kept through prepare
    assert planned_peak < 0.8 * plain_peak, (planned_peak, plain_peak)  # (recomputed)


def test_a_budget_the_first_batch_cannot_meet_is_refused_without_a_real_profile(
    caplog: Any,
) -> None:
    """Planned on ``meta``, a budget below the lowest peak raises there: the same answer a
    real profile would give, so none is run."""
    from torch import nn

    from autoremat.integrations.first_batch import FirstBatchPlanner

    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)))
    planner = FirstBatchPlanner(budget=1)
    planner.attach(model)
    with pytest.raises(autoremat.BudgetTooLow):
        model(torch.randn(32, 64)).sum().backward()
    assert "cannot be planned on meta" not in caplog.text
    assert planner.plan is None and not autoremat.wrap.wrapped_paths(model)


def test_a_first_batch_plan_of_the_hooked_modules_own_children_says_it_starts_a_step_late(
    caplog: Any,
) -> None:
    """A run of the hooked Sequential's own children swaps its class after its first forward
    had begun: that step's backward recomputes nothing (a child inside the run is not run
    again), the next one's does, and the planner says so, naming the fix."""
    from torch import nn

    from autoremat.core.entries import module_of
    from autoremat.integrations.first_batch import FirstBatchPlanner

    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())))
    recomputes = [0]
    model[4].register_forward_hook(
        lambda *_: recomputes.__setitem__(0, recomputes[0] + autoremat.is_recomputing())
    )
    planner = FirstBatchPlanner(budget="70%", objective="flops")
    planner.attach(model)
    counted = []
    for _ in range(2):
        recomputes[0] = 0
        loss = model(torch.randn(512, 256)).sum()
        recomputes[0] = 0  # (the plan's runs while planning are not the step's)
        loss.backward()
        counted.append(recomputes[0])
    assert planner.plan is not None and all(module_of(e) == "" for e in planner.plan.modules)
    assert counted == [0, 1]
    said = planner.plan.warnings["first_step"]
    assert "the plan recomputes Sequential itself" in said and said in caplog.text
