"""Claim 1: extraction of the modules that ran into a multi-way tree with their I/O."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autoremat
from autoremat.examples import EXAMPLES


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2)
        )
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, *, scale=1.0):
        for block in self.blocks:
            x = block(x) * scale
        return {"logits": self.head(x), "features": (x, [x.sum()])}


class Grows(nn.Module):
    """Calls itself once: the inner call returns 4 features, the outer 8."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: int = 1) -> torch.Tensor:
        y = self.lin(x)
        return y if n == 0 else torch.cat([self(y, n - 1), y], dim=-1)


def test_a_module_that_calls_itself_has_its_first_calls_inputs_and_outputs():
    """The I/O of a module's first call is that call's, also when the module calls itself
    inside it (the inner call ends first: its outputs were taken for the outer call's)."""
    tree = autoremat.build_tree(nn.Sequential(Grows()), (torch.randn(2, 4),))
    grows = tree.find("0")
    assert grows.calls == 2
    assert [t.shape for t in grows.inputs] == [(2, 4)]
    assert [t.shape for t in grows.outputs] == [(2, 8)]


def test_nodes_carry_name_path_children_module_and_io():
    model = Net()
    tree = autoremat.build_tree(model, (torch.randn(5, 8),), {"scale": 2.0})
    assert tree.path == "" and tree.module is model and tree.calls == 1
    # the ModuleList never ran: dissolved, its blocks are the root's children (in order);
    # the registered but unused module is not in the tree
    assert [c.path for c in tree.children] == ["blocks.0", "blocks.1", "head"]
    block = tree.find("blocks.1")
    assert block.name == "1" and block.module is model.blocks[1]
    assert [c.path for c in block.children] == ["blocks.1.0", "blocks.1.1", "blocks.1.2"]
    assert all(c.is_leaf for c in block.children) and not block.is_leaf
    fc = tree.find("blocks.1.0")
    assert fc.name == "0"
    assert [(t.shape, t.dtype, t.bytes) for t in fc.inputs] == [((5, 8), torch.float32, 160)]
    assert [(t.shape, t.bytes) for t in fc.outputs] == [((5, 16), 320)]
    # nested outputs (dict -> tuple -> list) are all found, with where they sat
    assert [(t.where, t.shape) for t in tree.outputs] == [
        ("out['logits']", (5, 2)),
        ("out['features'][0]", (5, 8)),
        ("out['features'][1][0]", ()),
    ]
    assert tree.output_bytes == 40 + 160 + 4
    with pytest.raises(KeyError, match="unused"):
        tree.find("unused")
    with pytest.raises(KeyError):
        tree.find("blocks")


def test_shared_module_lives_at_its_first_path_and_counts_its_calls():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    tree = autoremat.build_tree(model, (torch.randn(2, 4),))
    assert [c.path for c in tree.children] == ["0", "1"]
    assert tree.find("0").calls == 2 and tree.find("1").calls == 1


def test_hf_model_output_and_kwargs_are_recorded():
    model, args, kwargs = EXAMPLES["hf-gpt2"]()
    tree = autoremat.build_tree(model, args, kwargs)
    wheres = [t.where for t in tree.inputs]
    assert wheres == ["kwargs['input_ids']", "kwargs['labels']"]
    assert {t.where for t in tree.outputs} >= {"out['loss']", "out['logits']"}
    blocks = [
        n.path for n in tree.find("transformer").children if n.path.startswith("transformer.h")
    ]
    assert blocks == [f"transformer.h.{i}" for i in range(4)]
    assert tree.find("transformer.h.0").outputs[0].shape == (4, 128, 128)


def test_printing_shows_indented_paths_and_shapes():
    tree = autoremat.build_tree(Net(), (torch.randn(5, 8),))
    text = str(tree)
    assert "  (root): Net (float32[5, 8]) -> (float32[5, 2], float32[5, 8], +1)" in text
    assert "\n      blocks.0.0: Linear (float32[5, 8]) -> (float32[5, 16])" in text
    plan = autoremat.plan(Net(), (torch.randn(5, 8),), segments=1)
    assert plan.modules == ("blocks.0", "blocks.1")
    shown = str(plan)
    assert shown.startswith(
        "Plan for Net (levels, segments=1: the first level with more than 1 split point): "
        "recompute 2 modules"
    )
    assert "\n*   blocks.0: Sequential" in shown and "\n    head: Linear" in shown
    run = autoremat.Plan(modules=("blocks.0[0:2]",), strategy="budget", model_class="Net",
                         tree=tree)  # fmt: skip
    shown = str(run)  # a run marks the children it recomputes, not their Sequential
    assert "\n    blocks.0: Sequential" in shown and "\n*     blocks.0.0: Linear" in shown
    assert "\n*     blocks.0.1:" in shown and "\n*     blocks.0.2:" not in shown


def test_forward_failure_names_the_module():
    model = Net()
    with pytest.raises(RuntimeError, match=r"module 'blocks\.0\.0'.*pass args/kwargs"):
        autoremat.build_tree(model, (torch.randn(5, 3),))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_bad_model_and_model_without_submodules():
    with pytest.raises(TypeError, match=r"nn\.Module"):
        autoremat.build_tree(lambda x: x, (1,))
    with pytest.raises(ValueError, match="no submodules"):
        autoremat.plan(nn.Linear(2, 2), (torch.randn(1, 2),))


@pytest.mark.parametrize("segments", [-1, 1.5, True])
def test_bad_segments(segments):
    error = ValueError if segments == -1 else TypeError
    with pytest.raises(error, match="segments"):
        autoremat.plan(Net(), (torch.randn(5, 8),), segments=segments)
