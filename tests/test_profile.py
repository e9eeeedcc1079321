"""Per-node costs: exact figures on a toy chain, reconciliation down the tree, meta == real."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

import autoremat
from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.core.nested import storage_key
from autoremat.core.selective import WAYS
from autoremat.examples import EXAMPLES, llama_on_meta
from autoremat.planning.rehearsal import PlanFields, rehearsal_for
from autoremat.planning.solver import walk_peak
from moments import forward_moments

MiB = 2**20
RNG = int(torch.get_rng_state().numel())  # a checkpoint keeps one on the CPU
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
        # inclusive forward time: a node's window holds its children's (fastest of each)
        assert prof[f"{i}"].seconds >= prof[f"{i}.0"].seconds + prof[f"{i}.1"].seconds > 0
    assert prof[""].saved == 12 * MiB and prof[""].flops == 3 * MM
    assert prof.device == "cpu"


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


def test_a_storage_key_is_never_given_to_a_later_storage():
    """A recording keeps storages' keys after the storages are gone: a key must not be an
    address the next storage can take (with ``_cdata``, 90 of 100 fresh storages took one)."""
    t = torch.empty(8)
    assert storage_key(t[2:]) == storage_key(t.view(2, 4)) == storage_key(t) is not None
    keys = set()
    for _ in range(100):
        key = storage_key(torch.empty(8))
        assert key not in keys
        keys.add(key)


def _untimed(cost):
    ways = tuple(dataclasses.replace(w, op_seconds=0.0) for w in cost.ways)
    return dataclasses.replace(cost, seconds=0.0, op_seconds=0.0, ways=ways)


@pytest.mark.parametrize("name", ["hf-bert", "hf-vit"])
def test_two_profiles_of_one_step_have_the_same_figures(name):
    """With storages keyed by address, a freed input's key could be taken by a later output:
    ``attention.output``'s ``held_from`` then changed from one profile to the next (and
    ``fit``, which compares two batch sizes' profiles, could refuse the model at random)."""
    pytest.importorskip("transformers")
    model, args, kwargs = EXAMPLES[name]()
    first, second = (autoremat.profile(model, args, kwargs, timed=False) for _ in range(2))
    assert [_untimed(c) for c in first] == [_untimed(c) for c in second]


class ChecksItsOwnFunction(nn.Module):
    """A block that checkpoints a plain function itself (no module inside: nothing for
    autoremat to switch off), so its step keeps checkpoint's RNG states."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.reentrant = nn.Linear(64, 256), nn.Linear(256, 64), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = lambda h: nn.functional.gelu(h) * torch.sigmoid(h)  # noqa: E731
        hidden = torch.utils.checkpoint.checkpoint(act, self.fc1(x), use_reentrant=self.reentrant)
        return x + self.fc2(hidden)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_models_own_checkpoints_of_functions_count_their_rng_states(reentrant):
    """The profile counted none of its RNG states: a helper's model of 4 such blocks measured
    4 x 5,056 bytes above its plan's estimate and budget=1.0 (5 x with use_reentrant=True)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), *(ChecksItsOwnFunction(reentrant) for _ in range(4)))
    x = torch.randn(8, 32, 16)
    plan = autoremat.plan(model, (x,), budget=1.0)
    measured = autoremat.measure(model, (x,)).peak
    assert plan.baseline_peak == plan.estimated_peak == measured <= plan.budget


def test_loss_fn_costs_go_to_the_root():
    model = chain(1)
    x = torch.randn(2048, 512)
    without = autoremat.profile(model, (x,))
    with_loss = autoremat.profile(model, (x,), loss_fn=lambda out: (out * 2).pow(2).sum())
    # pow saves its input, the new 4 MiB tensor out * 2: counted at the root, outside any module
    assert with_loss[""].own_saved == without[""].own_saved + 4 * MiB
    assert with_loss["0"].saved == without["0"].saved == 4 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "hf-gpt2", "hf-llama", "cnn"])
def test_meta_device_gives_the_same_bytes_and_flops(name):
    """The same profile on ``meta`` as on the CPU: bytes, FLOPs and the step's memory timeline
    (Hugging Face models with their cache off on both: on ``meta`` their mask code is told
    the positions are ordinary, which it cannot read there; it ran with its cache on, 2-6%
    over, before)."""
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
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
        assert (other.freed, other.recompute_peak) == (cost.freed, cost.recompute_peak)
    assert (meta.peak, meta.forward_points, meta.backward_points) == (
        real.peak,
        real.forward_points,
        real.backward_points,
    )


@pytest.mark.slow
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


def nested_blocks() -> nn.Sequential:
    """Two blocks of two ``Linear, GELU, Linear`` parts: in each part GELU saves the first
    Linear's output and the second Linear saves GELU's, 4 MiB each, made inside the part."""
    torch.manual_seed(0)

    def part() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(512, 512, bias=False), nn.GELU(), nn.Linear(512, 512, bias=False)
        )

    return nn.Sequential(*(nn.Sequential(part(), part()) for _ in range(2)))


def chosen_items(
    prof: autoremat.costs.profile.Profile, entries: list[str], selective: list[str]
) -> list:
    """The planning items of ``entries`` (their selective way for those in ``selective``)."""
    from autoremat.planning.planning_tree import planning_tree

    items = {i.path: i for i in planning_tree(prof, rng_state=RNG).walk()}
    return [
        next(o for o in items[e].other_ways if o.way == "selective") if e in selective else items[e]
        for e in entries
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entries", "selective"), [(["1"], []), (["0", "1"], ["0", "1"]), (["1.0", "1.1"], [])]
)
def test_a_checkpointed_forward_is_priced_point_by_point(entries, selective):
    """While a checkpointed block's forward runs, what its finished parts saved is gone (the
    checkpoint drops it) and a selective one's cached outputs are held: at every point of the
    forward the walk's price is never under the measured live bytes; just after block 1's
    first part ends both are 8 MiB below the step without recompute (the walk lets a part's
    saved tensors go once the part has returned: an upper bound inside it)."""
    model, x = nested_blocks(), torch.randn(2048, 512)
    prof = autoremat.profile(model, (x,))
    chosen = chosen_items(prof, entries, selective)
    baseline = dict(prof.forward_points)

    def predicted(p: int) -> int:
        return (
            baseline[p]
            + sum(s.held_at(p) for s in chosen if s.start < p <= s.end)
            - sum(s.freed for s in chosen if s.end < p)
        )

    autoremat.wrap.apply(model, entries, selective=selective)
    measured = forward_moments(model, x)
    autoremat.remove(model)
    assert measured.keys() == baseline.keys()
    for p in baseline:
        assert measured[p] <= predicted(p), p
    if entries == ["1"]:
        after = prof["1.0"].end + 1
        assert measured[after] == predicted(after) - RNG == baseline[after] - 8 * MiB
    # each part's saved tensors (8 MiB) go once the part has returned, and the first part's
    # output (4 MiB), which the second saved, once the second has
    gone = [prof["1.0"].end + 1, prof["1.1"].end + 1]
    assert prof["1"].held_from == ((gone[0], -8 * MiB), (gone[1], -12 * MiB))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("entries", "selective"),
    [
        (["1"], []),
        (["0"], []),
        (["0", "1"], ["0", "1"]),
        (["1.0", "1.1"], []),
        (["0.0", "0.1", "1"], ["1"]),
    ],
)
def test_predicted_step_peak_is_the_measured_one_on_nested_blocks(entries, selective):
    """The whole model, recompute peaks included: a plan's step run (whole or selective) is the
    measured peak to the byte, and the walk prices it no lower."""
    model, x = nested_blocks(), torch.randn(2048, 512)
    prof = autoremat.profile(model, (x,))
    chosen = chosen_items(prof, entries, selective)
    fields = PlanFields(tuple(entries), {e: WAYS["selective"] for e in selective})
    autoremat.wrap.apply(model, entries, selective=selective)
    measured = autoremat.measure(model, (x,)).peak
    autoremat.remove(model)
    assert rehearsal_for(prof).peak(fields) == measured
    assert walk_peak(chosen, prof.backward_points, prof.forward_points) >= measured


@pytest.mark.parametrize(
    ("entries", "selective"),
    [(["1"], []), (["0", "1"], ["0", "1"]), (["1.0", "1.1"], []), (["0.0", "0.1", "1"], ["1"])],
)
def test_under_autocast_a_checkpointed_forward_keeps_its_weight_casts_until_the_forward_ends(
    entries, selective
):
    """Under bf16 autocast a checkpointed block still casts its weights in the forward, and
    autocast's cast cache keeps the copies until the forward's region ends; they are freed
    when backward begins. The profile says which part of what a block frees that is (its four
    weights in bf16); the walk prices the plan no lower than its run, which is the measured
    peak to the byte. (Priced as freed from the block's end, the plan recomputing block 1
    was under by its 2 MiB of casts.)"""
    model, x = nested_blocks(), torch.randn(64, 512)  # (bf16 CPU matmuls are slow: few rows)
    prof = autoremat.profile(model, (x,), autocast=torch.bfloat16)
    assert prof["1"].cached == 4 * 512 * 512 * 2
    chosen = chosen_items(prof, entries, selective)
    predicted = walk_peak(chosen, prof.backward_points, prof.forward_points)
    fields = PlanFields(tuple(entries), {e: WAYS["selective"] for e in selective})
    run = rehearsal_for(prof).peak(fields)
    autoremat.wrap.apply(model, entries, selective=selective)
    measured = autoremat.measure(model, (x,), autocast=torch.bfloat16).peak
    with RecomputeCounter() as seen:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).sum()
        loss.backward()
    autoremat.remove(model)
    assert not seen.missing(entries)
    assert run == measured <= predicted
