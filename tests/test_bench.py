"""The side-by-side benchmark harness (autoremat.comparison, and benchmarks/report.py): tiny
models, one timed step, no compile."""

from __future__ import annotations

import copy
import csv
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autoremat import build_tree, wrap
from autoremat.comparison import (
    Applied,
    Contender,
    Row,
    budget_plan,
    compare,
    every_block,
    find_blocks,
    levels_plan,
    no_recompute,
    saved_by_autograd,
    sqrt_segments,
    to_markdown,
)
from autoremat.examples import ConvNet, TinyGPT
from autoremat.record.tree import Node

# CSV files and plots are the benchmark scripts' (benchmarks/report.py), not the package's
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from report import from_csv, plot, to_csv


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are tiny, and on a shared 2-core machine a second OpenMP
    thread that loses its core stalls every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt() -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, width=32, layers=4, heads=2, context=32).train()
    idx = torch.randint(0, 64, (2, 32))
    return model, (idx,), {"targets": torch.roll(idx, -1, dims=1)}


def chain(n: int = 8, batchnorm: bool = False) -> tuple[nn.Module, tuple, dict]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(16, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else []) + [nn.GELU()]
    return nn.Sequential(*layers).train(), (torch.randn(32, 16),), {}


ALL = [no_recompute(), every_block(), sqrt_segments()] + [levels_plan(k) for k in (1, 2, 4)]


# ---------------------------------------------------------------- find_blocks


class A(nn.Module):
    pass


class B(nn.Module):
    pass


def node(path: str, module: nn.Module, *children: Node) -> Node:
    return Node(name=path.rsplit(".", 1)[-1], path=path, module=module, children=list(children))


def leaf(path: str) -> Node:
    return node(path, nn.Linear(1, 1))


def test_find_blocks_picks_the_largest_group_of_non_leaf_siblings() -> None:
    tree = node(
        "",
        A(),
        node("x", A(), leaf("x.0")),
        node("y", A(), leaf("y.0")),
        node(
            "z",
            B(),
            node("z.0", B(), leaf("z.0.0")),
            node("z.1", B(), leaf("z.1.0")),
            node("z.2", B(), leaf("z.2.0")),
            node("z.3", A(), leaf("z.3.0")),
        ),
        leaf("w0"),
        leaf("w1"),
        leaf("w2"),
        leaf("w3"),  # four leaves of one class: leaves are never blocks
    )
    assert find_blocks(tree) == ["z.0", "z.1", "z.2"]


def test_find_blocks_ties_go_to_the_shallower_group() -> None:
    deep = node("d", B(), node("d.0", A(), leaf("d.0.0")), node("d.1", A(), leaf("d.1.0")))
    tree = node("", A(), deep, node("e", B(), leaf("e.0")))
    # {d, e} (class B, depth 1) and {d.0, d.1} (class A, depth 2) both have two members
    assert find_blocks(tree) == ["d", "e"]


def test_find_blocks_needs_two_members() -> None:
    assert find_blocks(node("", A(), leaf("a"), leaf("b"), leaf("c"))) == []
    assert find_blocks(node("", A(), node("x", B(), leaf("x.0")), leaf("b"))) == []
    assert find_blocks(leaf("")) == []


def test_find_blocks_by_container_takes_numbered_siblings_of_any_class() -> None:
    """A hybrid model's layers (``layers.0`` a mamba layer, ``layers.1`` an attention layer,
    ...): one group by their container, where by class the larger class alone is a group."""
    tree = node(
        "",
        A(),
        node("layers.0", A(), leaf("layers.0.0")),
        node("layers.1", B(), leaf("layers.1.0")),
        node("layers.2", A(), leaf("layers.2.0")),
        node("head", A(), leaf("head.0")),  # not numbered: not one of the layers
        leaf("layers.3"),  # a leaf: never a block
    )
    assert find_blocks(tree) == ["layers.0", "layers.2", "head"]
    assert find_blocks(tree, by="container") == ["layers.0", "layers.1", "layers.2"]
    two = node("", A(), node("m.0", A(), leaf("m.0.0")), node("m.1", B(), leaf("m.1.0")))
    assert find_blocks(two) == []  # no two of one class
    assert find_blocks(two, by="container") == ["m.0", "m.1"]
    with pytest.raises(ValueError, match="'class' or 'container'"):
        find_blocks(two, by="type")


def test_find_blocks_on_real_trees() -> None:
    model, args, kwargs = tiny_gpt()
    assert find_blocks(build_tree(model, args, kwargs)) == ["h.0", "h.1", "h.2", "h.3"]
    cnn = ConvNet(widths=(4, 8, 8))
    tree = build_tree(cnn, (torch.randn(2, 3, 16, 16),), {})
    assert find_blocks(tree) == ["features.0", "features.1", "features.2"]
    model, args, kwargs = chain()
    assert find_blocks(build_tree(model, args, kwargs)) == []


# ---------------------------------------------------------------- compare


@pytest.mark.slow
def test_compare_rows_baseline_and_gradients() -> None:
    model, args, kwargs = tiny_gpt()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    rows = compare(model, args, kwargs, ALL, repeats=1, name="tiny")
    names = [r.strategy for r in rows]
    # sqrt segments does not apply (not a chain); levels s=1 and s=2 pick the same 4 blocks as
    # every block, so they are dropped; s=4 picks each block's attn and mlp
    assert names == ["none", "every block", "levels s=4"]
    assert len(names) == len(set(names))
    base = rows[0]
    assert (base.peak_ratio, base.saved_ratio, base.flops_ratio, base.time_ratio) == (1, 1, 1, 1)
    assert base.autograd_saved_ratio == 1
    for r in rows:
        assert r.model == "tiny"
        assert r.grads_match, (r.strategy, r.note)
        assert not r.compiled
        assert r.seconds is not None and r.seconds > 0
        assert r.peak is not None and r.flops is not None
    every = rows[1]
    assert every.saved_ratio is not None and every.saved_ratio < 0.5
    assert every.flops_ratio is not None and every.flops_ratio > 1.0
    assert "wraps 4: h.0" in every.note
    assert "same plan as levels s=1, levels s=2" in every.note
    assert "wraps 8: h.0.attn, h.0.mlp" in rows[2].note
    # the user's model is untouched
    assert type(model) is TinyGPT
    for n, v in model.state_dict().items():
        assert torch.equal(v, before[n])


def test_compare_on_a_chain() -> None:
    model, args, kwargs = chain()
    rows = compare(model, args, kwargs, ALL, repeats=1)
    names = [r.strategy for r in rows]
    assert names == ["none", "sqrt segments", "levels s=1"]  # no blocks; one levels plan
    assert rows[0].model == "Sequential"
    assert all(r.grads_match for r in rows)
    assert "4 segments of 16" in rows[1].note
    assert rows[1].autograd_saved_ratio is not None and rows[1].autograd_saved_ratio < 0.6
    assert "wraps 1: (root)" in rows[2].note


def test_compare_flags_batchnorm_moved_twice_by_checkpoint_sequential() -> None:
    model, args, kwargs = chain(4, batchnorm=True)
    rows = compare(model, args, kwargs, [sqrt_segments(), levels_plan(4)], repeats=1)
    by = {r.strategy: r for r in rows}
    assert by["sqrt segments"].grads_match
    assert "buffers differ" in by["sqrt segments"].note  # pytorch#96136
    assert "buffers differ" not in by["levels s=4"].note  # autoremat restores them


def test_compare_adds_the_baseline_and_reports_failures() -> None:
    def broken(model: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
        raise RuntimeError("boom")

    model, args, kwargs = chain(2)
    rows = compare(model, args, kwargs, [Contender("broken", broken)], repeats=1)
    assert [r.strategy for r in rows] == ["none", "broken"]
    assert rows[1].seconds is None and not rows[1].grads_match
    assert "failed: RuntimeError: boom" in rows[1].note
    with pytest.raises(ValueError, match="repeats"):
        compare(model, args, kwargs, [], repeats=-1)
    (untimed,) = compare(model, args, kwargs, [], repeats=0)  # measured, not timed
    assert untimed.seconds is None and untimed.time_ratio is None and untimed.peak


@pytest.mark.slow
def test_every_block_on_hugging_face_gpt2_reduces_saved_bytes() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 32))
    kwargs = {"input_ids": ids, "labels": ids}
    rows = compare(model, (), kwargs, [no_recompute(), every_block()], repeats=1)
    base, every = rows
    assert every.note.startswith("HF activation_checkpointing_enable")
    assert every.grads_match, every.note
    assert every.saved < base.saved
    assert every.autograd_saved < base.autograd_saved
    assert every.peak < base.peak
    assert not model.is_gradient_checkpointing  # the copy was changed, not the model


def test_baseline_runs_hugging_face_models_without_their_cache() -> None:
    """The no-recompute row runs the step the plans run: no key/value cache while training
    (a cache would add its own memory and time to the baseline only); inference keeps it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 32))
    assert model(input_ids=ids).past_key_values is not None  # on by default
    applied = no_recompute().apply(copy.deepcopy(model), (), {"input_ids": ids})
    assert isinstance(applied, Applied)
    baseline = applied.model
    assert baseline(input_ids=ids).past_key_values is None
    with torch.no_grad():
        assert baseline(input_ids=ids).past_key_values is not None


def test_saved_by_autograd_counts_the_selective_cache() -> None:
    def block() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 8, bias=False), nn.GELU(), nn.Linear(8, 8, bias=False))

    torch.manual_seed(0)
    net = nn.Sequential(block(), block())
    x = torch.randn(32, 8)
    a = 32 * 8 * 4  # every activation: 32 x 8 float32
    # each block saves GELU's input h and the second matmul's input act(h); block 1's first
    # matmul saves block 0's output g: 5 activations
    assert saved_by_autograd(net, (x,)) == 5 * a
    # block 0 recomputed whole: its h and act(h) are gone (its input x is an input)
    whole = wrap.apply(copy.deepcopy(net), ["0"])
    assert saved_by_autograd(whole, (x,)) == 3 * a
    # selectively: the checkpoint's cache keeps the matmul outputs h and g (g is saved anyway);
    # saved_tensors_hooks do not see that cache
    sel = wrap.apply(copy.deepcopy(net), ["0"], selective=["0"])
    assert saved_by_autograd(sel, (x,)) == 4 * a
    assert saved_by_autograd(sel, (x,), selective_cache=False) == 3 * a


@pytest.mark.slow
def test_budget_strategy_names_the_module_only_variant() -> None:
    assert budget_plan(0.5).name == "budget 50%"
    assert budget_plan(0.5, selective=False).name == "budget 50% (module)"
    assert budget_plan("min", selective=False).name == "budget min (module)"
    model, args, kwargs = tiny_gpt()
    strategies = [budget_plan(0.5, selective=False), budget_plan(0.5)]
    rows = compare(model, args, kwargs, strategies, repeats=1, name="tiny")
    assert [r.strategy for r in rows] == ["none", "budget 50% (module)", "budget 50%"]
    assert "entries (0 selective)" in rows[1].note
    assert re.search(r"entries \(\d+ selective\)", rows[2].note)
    assert all(r.grads_match for r in rows), [r.note for r in rows]
    assert all(r.peak is not None and r.peak <= 0.5 * rows[0].peak for r in rows[1:])


def test_saved_by_autograd_counts_activations_only() -> None:
    lin = nn.Linear(8, 4)
    x = torch.randn(16, 8)
    # Linear saves its input and weight: neither counts
    assert saved_by_autograd(lin, (x,)) == 0
    net = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    # ReLU saves its output (16 x 4 float32) and the default loss saves nothing
    assert saved_by_autograd(net, (x,)) == 16 * 4 * 4
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.slow
def test_rows_carry_the_plan_applied_and_bare_modules_are_accepted() -> None:
    model, args, kwargs = tiny_gpt()
    bare = Contender("bare", lambda m, a, k: m)  # a bare module is taken as Applied(module)
    rows = compare(model, args, kwargs, [budget_plan(0.5), levels_plan(4), bare], repeats=1)
    by = {r.strategy: r for r in rows}
    assert set(by) == {"none", "budget 50%", "levels s=4", "bare"}
    assert by["none"].plan is None and by["bare"].plan is None
    assert by["bare"].grads_match and by["bare"].note == ""
    plan = by["budget 50%"].plan
    assert plan is not None and plan.tree is None  # the tree would keep the model copy alive
    assert plan.estimated_peak is not None
    assert f"predicted peak {plan.estimated_peak / 2**20:.1f} MiB" in by["budget 50%"].note
    assert by["levels s=4"].plan is not None and by["levels s=4"].plan.segments == 4


# ---------------------------------------------------------------- reports


def sample_rows() -> list[Row]:
    model, args, kwargs = chain(4)
    rows = compare(model, args, kwargs, ALL, repeats=1, name="chain")
    rows.append(
        Row(
            model="chain",
            strategy="compile b=0.5",
            peak=None,
            saved=100,
            autograd_saved=100,
            flops=10**9,
            seconds=0.01,
            time_spread=0.1,
            peak_ratio=None,
            saved_ratio=0.5,
            autograd_saved_ratio=0.5,
            flops_ratio=1.2,
            time_ratio=0.9,
            grads_match=True,
            note="compile 3 s, 2 graphs | test",
            compiled=True,
        )
    )
    return rows


def test_markdown_has_a_header_and_one_line_per_row() -> None:
    rows = sample_rows()
    lines = to_markdown(rows).splitlines()
    assert lines[0].startswith("| model | strategy | peak MiB")
    assert set(lines[1]) <= set("|-:")
    assert len(lines) == 2 + len(rows)
    assert all(line.count(" | ") == lines[0].count(" | ") for line in lines[2:])
    assert "n/a" in lines[-1]  # the compiled row has no peak


def test_csv_round_trips(tmp_path) -> None:
    rows = sample_rows()
    path = tmp_path / "r.csv"
    to_csv(rows, path)
    with open(path, newline="") as f:
        back = list(csv.DictReader(f))
    assert len(back) == len(rows)
    for row, rec in zip(rows, back, strict=True):
        assert rec["model"] == row.model and rec["strategy"] == row.strategy
        assert rec["note"] == row.note
        assert rec["grads_match"] == str(row.grads_match)
        assert (rec["peak"] == "") == (row.peak is None)
        if row.peak is not None:
            assert int(rec["peak"]) == row.peak
        assert math.isclose(float(rec["seconds"]), row.seconds)
        assert float(rec["flops_ratio"]) == row.flops_ratio
    assert "plan" not in back[0]  # an object, not a figure
    assert from_csv(path) == rows  # rows compare equal whatever their plan


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path) -> None:
    path = tmp_path / "r.png"
    plot(sample_rows(), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


@pytest.mark.slow
def test_cli_bench(capsys, tiny) -> None:
    from autoremat.cli.commands import main

    assert main(["bench", tiny, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(f"| {tiny} |")]
    assert "| model | strategy |" in out
    assert [line.split(" | ")[1] for line in lines][:2] == ["none", "every block"]
    assert "DIFFER" not in out
