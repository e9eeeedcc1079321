"""Real architectures from torchvision, timm, diffusers, transformers and peft (the library
zoo, ``benchmarks/library_zoo``): named Sequentials, dense connectivity, each library's own
checkpointing switch, lazily installed Hugging Face hooks, router losses.

These need the ``zoo`` extra, which lives in a venv of its own (``make zoo-test``, which CI
runs; ``make zoo`` runs the whole zoo). Without it they are skipped.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import autoremat
from autoremat.core.own_checkpointing import switched_on

_missing = [
    name
    for name in ("torchvision", "timm", "diffusers", "peft")
    if importlib.util.find_spec(name) is None
]
if _missing:
    reason = f"needs the zoo extra ({', '.join(_missing)}): make zoo-test"
    pytest.skip(reason, allow_module_level=True)

# (after the check: importing library_zoo makes torchvision importable beside CPU torch)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from library_zoo import ZOO, own_checkpointing_on  # noqa: E402
from library_zoo.check import check, check_calls  # noqa: E402

pytestmark = pytest.mark.slow


def test_torchvision_imports_beside_cpu_torch_and_its_ops_say_why_they_fail() -> None:
    """The shim (library_zoo.torchvision_cpu) makes torchvision import; its C++ ops are still
    absent, and say so in torchvision's own words."""
    import torchvision

    assert not torchvision.extension._has_ops()
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    with pytest.raises(RuntimeError, match="Couldn't load custom C"):
        torchvision.ops.nms(boxes, torch.ones(1), 0.5)


@pytest.mark.parametrize(
    "name",
    [
        "tv_densenet",  # named Sequential, a list its caller appends to after the call
        "tv_regnet",  # named Sequential stages
        "timm_levit",  # named Sequentials, BatchNorm in every linear
        "tv_swin",  # runs of a Sequential MLP that start at a Dropout
        "tv_vit",  # attention whose input nothing saves: held through its own backward
        "df_unet",  # down blocks whose skip outputs the up path takes
        "df_vae",  # a sampled posterior
        "hf_olmoe",  # mixture of experts with its router loss
    ],
)
def test_mid_and_lowest_plans_train_exactly_recompute_and_hold_in_fp32(name: str) -> None:
    """Both plans train two steps bit for bit as the model without recompute, every entry was
    recomputed, the measured peak is at or under the budget and estimated within
    ESTIMATE_BOUNDS, nothing of the model changed."""
    row = check(ZOO[name], "fp32", own=False, objective="flops")  # the same plan every run
    assert row.failures() == []
    assert row.mid is not None and row.low is not None
    assert row.mid.entries and row.low.entries  # something was planned to recompute


@pytest.mark.parametrize(
    "name",
    [
        "df_vae",  # a tensor its Sequential loops let go as soon as the next part has read it
        "hf_falcon",  # a LayerNorm output both attention and MLP take
        "hf_t5",  # an encoder output the model returns and the decoder takes
        "tv_vit",  # autocast's cast cache
    ],
)
def test_bf16_plans_hold_and_are_predicted_within_the_bounds(name: str) -> None:
    """Under bf16 autocast both plans train exactly, recompute, hold their budget, and are
    estimated within ESTIMATE_BOUNDS (mid -0.5% to +2%, lowest -0.5% to +5%)."""
    row = check(ZOO[name], "bf16", own=False, objective="flops")
    assert row.failures() == []
    assert row.mid is not None and row.low is not None
    assert row.mid.estimate_error is not None and row.low.estimate_error is not None


@pytest.mark.parametrize(
    "name", ["timm_vit", "df_unet_conditional", "hf_gemma2", "peft_lora_llama"]
)
def test_a_model_that_checkpoints_itself_is_planned_with_its_switch_off(name: str) -> None:
    """Each library's own switch on (timm set_grad_checkpointing, diffusers
    enable_gradient_checkpointing, transformers gradient_checkpointing_enable, through peft
    too): the plans are made and applied with it off, train exactly as the model without
    either, and remove() turns it back on; the user's model keeps it on throughout."""
    row = check(ZOO[name], "fp32", own=True, objective="flops")
    assert row.failures() == []
    model, args, kwargs = ZOO[name].build()
    assert own_checkpointing_on(model)
    before = len(switched_on(model))
    autoremat.plan(model, args, kwargs, budget="90%")
    assert len(switched_on(model)) == before > 0


@pytest.mark.parametrize(
    "name, fit",
    [
        ("hf_llama", "batch "),
        ("timm_levit", "batch "),  # cannot train at batch 1: fit starts from 2
        # BERT's mask code calls .item(), which meta cannot: sized from real steps, scaled
        ("hf_bert", "batch "),
        # transformers' grouped experts call torch._grouped_mm, whose meta kernel wants bf16:
        # sized from real steps. Tokens are routed by value, but the batches fit tries repeat
        # the example's rows, routed alike: from 4 and 6 on (a recompute's highest moment
        # settles) the step scales exactly (the check from 2 and 4 to 6 alone refused it)
        ("hf_olmoe", "batch "),
    ],
)  # fmt: skip
def test_plan_measure_and_fit_leave_the_users_model_as_found(name: str, fit: str) -> None:
    """After lowest_budget, plan, measure and fit, every parameter, buffer, flag, attribute,
    hook and the random state are as before, and a forward (``output_hidden_states=True``)
    gives what a fresh model gives: the lazily installed output-capturing hooks still work."""
    calls = check_calls(ZOO[name])
    assert calls.failures() == []
    assert calls.probe_same is True
    assert calls.fit.startswith(fit), calls.fit
