"""LayerDrop (a transformers BART that skips each layer at random in training): autoremat's
own steps run every layer, the most a step holds, so a plan made from them holds its budget
on the training steps that skip layers, and ``fit`` can scale its steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import autoremat
from autoremat.record.memory import LiveMemory
from autoremat.training.scale_batch import scale_batch
from conftest import assert_same_step, train_step

transformers = pytest.importorskip("transformers")

DROP = 0.3


def bart(tokens: int = 32) -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, encoder_layerdrop=DROP,
        decoder_layerdrop=DROP,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    ids = torch.randint(0, 128, (4, tokens))
    return model, {"input_ids": ids, "labels": ids}


def layers_run(model: Any, kwargs: dict[str, torch.Tensor], seed: int) -> set[str]:
    """The encoder and decoder layers a training step with ``seed`` runs (LayerDrop on)."""
    ran: set[str] = set()
    handles = [
        m.register_forward_hook(lambda *_, p=path: ran.add(p))
        for path, m in model.named_modules()
        if path.rsplit(".", 1)[0].endswith("layers")
    ]
    train_step(model, (), kwargs, seed)
    for h in handles:
        h.remove()
    return ran


def test_autoremat_runs_every_layer_and_leaves_layerdrop_as_found() -> None:
    """The same peak whatever the RNG (before: 1.39 to 3.94 MB over six seeds), the peak of
    the step with LayerDrop 0; the model's LayerDrop is put back."""
    model, kwargs = bart()
    peaks = set()
    for seed in range(4):
        torch.manual_seed(seed)
        peaks.add(autoremat.measure(model, (), kwargs).peak)
    assert model.model.encoder.layerdrop == model.config.decoder_layerdrop == DROP
    plain = copy.deepcopy(model)
    plain.model.encoder.layerdrop = plain.model.decoder.layerdrop = 0.0
    assert peaks == {autoremat.measure(plain, (), kwargs).peak}
    assert len(layers_run(model, kwargs, 1)) < 8  # (the training step does skip layers)


def test_a_budget_plan_holds_on_steps_that_skip_layers_and_trains_exactly() -> None:
    model, kwargs = bart()
    plan = autoremat.plan(model, (), kwargs, budget="50%", objective="flops")
    assert plan.budget is not None and not plan.left_out
    wrapped = plan.apply(copy.deepcopy(model))
    for seed in range(4):
        with LiveMemory.counting_as("cpu") as memory:
            train_step(wrapped, (), kwargs, seed)
        assert memory.peak <= plan.budget, (seed, memory.peak, plan.budget)
    ran = layers_run(model, kwargs, 1)
    entries = [e for e in plan.modules if e in ran]
    assert entries and len(ran) < 8  # (a step that skips layers, recomputing those it ran)
    assert_same_step(model, wrapped, (), kwargs, entries)


@pytest.mark.slow
def test_fit_sizes_a_layerdrop_model_from_real_steps() -> None:
    """BART's mask code reads values, so ``fit`` scales real steps: with LayerDrop they
    differed from one batch to the next and ``fit`` refused it (``NotScalable``)."""
    model, kwargs = bart()
    found = autoremat.fit(
        model, lambda b: scale_batch((), kwargs, b), device_memory="16MiB", max_batch=8,
        verify=False,
    )  # fmt: skip
    assert found.batch == 8 and found.chosen is not None
    assert found.chosen.memory.device <= found.device.limit
