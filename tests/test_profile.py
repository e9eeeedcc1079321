"""Per-node costs: exact figures on a toy chain, reconciliation down the tree, meta == real."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import autoremat
from autoremat.examples import EXAMPLES, llama_on_meta

MiB = 2**20
MM = 2 * 2048 * 512 * 512  # FLOPs of one (2048 x 512) @ (512 x 512) matmul


def chain(blocks: int = 3) -> nn.Sequential:
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(512, 512, bias=False), nn.ReLU()) for _ in range(blocks))
    )


def test_exact_bytes_and_flops_on_a_chain():
    """Each block's Linear saves its input and its ReLU saves its output (4 MiB each). The first
    Linear's input is the example input (it existed before: not counted); every later Linear's
    input is the previous ReLU's output, already counted there. So each block saves exactly one
    4 MiB activation, at its ReLU, and does one matmul."""
    torch.manual_seed(0)
    model = chain()
    prof = autoremat.profile(model, (torch.randn(2048, 512),))
    for i in range(3):
        assert prof[f"{i}"].saved == 4 * MiB
        assert prof[f"{i}.1"].own_saved == 4 * MiB
        assert prof[f"{i}.0"].saved == 0
        assert prof[f"{i}"].flops == MM
        assert prof[f"{i}.0"].own_flops == MM
        assert prof[f"{i}"].param_bytes == MiB
        assert prof[f"{i}"].input_bytes == prof[f"{i}"].output_bytes == 4 * MiB
        assert prof[f"{i}"].calls == 1
        assert prof[f"{i}"].seconds > 0
    assert prof[""].saved == 12 * MiB and prof[""].flops == 3 * MM
    assert prof.device == "real"


@pytest.mark.parametrize("name", ["gpt2", "hf-bert", "unet"])
def test_figures_reconcile_down_the_tree(name):
    model, args, kwargs = EXAMPLES[name]()
    prof = autoremat.profile(model, args, kwargs)
    assert [c.path for c in prof] == [n.path for n in prof.tree.walk()]
    for node in prof.tree.walk():
        cost = prof[node.path]
        kids = [prof[c.path] for c in node.children]
        assert cost.saved == cost.own_saved + sum(k.saved for k in kids)
        assert cost.flops == cost.own_flops + sum(k.flops for k in kids)
        # tied weights (GPT-2's embedding and head) count once at a common ancestor
        assert cost.param_bytes >= max([k.param_bytes for k in kids], default=0)
        assert cost.seconds >= 0
    assert prof[""].saved > 0 and prof[""].flops > 0


def test_loss_fn_costs_go_to_the_root():
    model = chain(1)
    x = torch.randn(2048, 512)
    without = autoremat.profile(model, (x,))
    with_loss = autoremat.profile(model, (x,), loss_fn=lambda out: (out * 2).pow(2).sum())
    # pow saves its input, the new 4 MiB tensor out * 2: counted at the root, outside any module
    assert with_loss[""].own_saved == without[""].own_saved + 4 * MiB
    assert with_loss["0"].saved == without["0"].saved == 4 * MiB


@pytest.mark.parametrize("name", ["gpt2", "hf-gpt2", "cnn"])
def test_meta_device_gives_the_same_bytes_and_flops(name):
    model, args, kwargs = EXAMPLES[name]()
    real = autoremat.profile(model, args, kwargs)
    with torch.device("meta"):  # the same model built on meta: no memory, weights still tied
        meta_model, meta_args, meta_kwargs = EXAMPLES[name]()
    meta = autoremat.profile(meta_model, meta_args, meta_kwargs)
    assert meta.device == "meta"
    for cost in real:
        other = meta[cost.path]
        assert (other.saved, other.flops, other.param_bytes, other.calls) == (
            cost.saved,
            cost.flops,
            cost.param_bytes,
            cost.calls,
        ), cost.path


def test_llama_2_7b_shape_on_meta():
    """32 layers, width 4096, sequence 4096, built and profiled without memory. Forward FLOPs
    are 2 x (parameters less the embedding table) x tokens plus attention's
    4 x layers x seq^2 x width (QK^T and AV)."""
    pytest.importorskip("transformers")
    model, args, kwargs = llama_on_meta()
    prof = autoremat.profile(model, args, kwargs)
    params = sum(p.numel() for p in model.parameters())
    embedding = 32000 * 4096
    expected = 2 * (params - embedding) * 4096 + 4 * 32 * 4096**2 * 4096
    assert prof[""].flops == pytest.approx(expected, rel=0.01)
    layer = prof["model.layers.5"]
    assert layer.calls == 1 and layer.param_bytes == 202383360 * 4
    assert prof[""].saved > 32 * layer.saved > 0
    assert prof[""].seconds == pytest.approx(prof[""].flops / 1e11)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_only(monkeypatch):
    model, x = chain(2), torch.randn(8, 512)
    tty = FakeTTY()
    monkeypatch.setattr("sys.stderr", tty)
    autoremat.profile(model, (x,))
    assert "profiling [" in tty.getvalue() and "7/7 module calls" in tty.getvalue()
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    autoremat.profile(model, (x,))
    assert pipe.getvalue() == ""


def test_profile_leaves_the_model_as_found_and_refuses_a_wrapped_model():
    model, args, kwargs = EXAMPLES["cnn"]()
    state = copy.deepcopy(model.state_dict())
    rng = torch.random.get_rng_state()
    autoremat.profile(model, args, kwargs)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    autoremat.plan(model, args, kwargs).apply(model)
    with pytest.raises(ValueError, match=r"autoremat\.remove"):
        autoremat.profile(model, args, kwargs)
