"""The live-memory tracker and `measure`, pinned to exact byte and FLOP counts on toy models.

Toy model: ``nn.Sequential`` of two MLP blocks, each ``Linear(512, 512, bias=False), ReLU,
Linear, ReLU``, fed ``x`` of shape (2048, 512) float32 that does not require grad. Every
activation is 2048 x 512 x 4 B = 4 MiB (``A``), every weight and weight gradient is
512 x 512 x 4 B = 1 MiB (``W``). The loss is ``default_loss``: ``out.sum(dtype=float32)``, a 4 B
scalar; backward starts from ``ones_like(loss)``, another 4 B. Names used in the comments:

    block 0:  h0 = x @ W0.T   m0 = relu(h0)   g0 = m0 @ W1.T   o0 = relu(g0)
    block 1:  h1 = o0 @ W2.T  m1 = relu(h1)   g1 = m1 @ W3.T   o1 = relu(g1)  (the output)

Without checkpointing autograd keeps m0, o0, m1, o1 (ReLU saves its output, mm saves its
input); h0, g0, h1, g1 die as soon as the next ReLU has run. Gradients are written d<name>
(dW3 is the weight gradient of the last Linear).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from autoremat.examples import EXAMPLES
from autoremat.record.measure import Measurement, measure
from autoremat.record.memory import LiveMemory
from autoremat.record.step import default_loss
from autoremat.wrap.wrapping import apply, remove

MiB = 2**20
A = 4 * MiB  # one activation, 2048 x 512 float32
W = 1 * MiB  # one weight or weight gradient, 512 x 512 float32
LOSS = 4  # the float32 loss scalar
ONES = 4  # the float32 ones_like(loss) that backward starts from
UNIT = 2 * 2048 * 512 * 512  # FLOPs of one forward matmul, 2*M*N*K


def linear() -> nn.Linear:
    return nn.Linear(512, 512, bias=False)


def block() -> nn.Sequential:
    return nn.Sequential(linear(), nn.ReLU(), linear(), nn.ReLU())


def two_blocks(device: str = "cpu") -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(block(), block()).to(device)


def batch(device: str = "cpu") -> torch.Tensor:
    if device == "meta":
        return torch.empty(2048, 512, device="meta")
    return torch.randn(2048, 512, generator=torch.Generator().manual_seed(1))


def mm_must_save(ctx, op, *args, **kwargs):
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class FirstBlockCheckpointed(nn.Module):
    """``two_blocks`` with block 0 under non-reentrant checkpoint, fully or selectively."""

    def __init__(self, blocks: nn.Sequential, selective: bool = False) -> None:
        super().__init__()
        self.blocks = blocks
        self.selective = selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {}
        if self.selective:
            extra["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, mm_must_save
            )
        x = checkpoint(self.blocks[0], x, use_reentrant=False, **extra)
        return self.blocks[1](x)


# Hand-derived figures for the toy model (the tests below check them to the byte).
#
# No checkpointing.
#   saved: m0, o0, m1, o1 + loss.
#   peak: in MmBackward of block 1's second Linear, when its two outputs exist: m0, o0, m1, o1
#   (o1 is still referenced by the caller's output), dg1 (from ReluBackward), dm1 and dW3,
#   plus loss and ones. The next step (ReluBackward: dh1 made, dg1 gone) holds as much; later
#   steps hold less (m1, then o0 and m0 are released as their backward nodes run).
PLAIN_SAVED = 4 * A + LOSS
PLAIN_PEAK = 6 * A + W + LOSS + ONES
# Full checkpoint of block 0.
#   saved: o0 (checkpoint output, saved by block 1's first mm), m1, o1 + loss; m0 is dropped.
#   peak: block 1's backward holds at most o0, m1, o1, dg1, dm1, dW3 = 5A + W. The largest
#   moment is the end of block 0's recompute, triggered when backward reaches block 0: alive are
#   o1, do0, dW3, dW2 (o0 itself has been freed: its last holder, block 1's first MmBackward,
#   has run) and the recomputed m0', g0', o0' (h0' already died): 5A + 2W. ReluBackward then
#   makes dg0 after g0' has died: o1, do0, m0', o0', dg0, dW3, dW2, the same again.
#   On the CPU the tracker also counts the RNG state checkpoint keeps from the forward to the
#   backward, and the one its recompute keeps while it runs (RNG bytes each): one in what is
#   saved, two at the peak (in the recompute).
RNG = int(torch.get_rng_state().numel())
CKPT_SAVED = 3 * A + LOSS + RNG
CKPT_PEAK = 5 * A + 2 * W + LOSS + ONES + 2 * RNG
# Selective checkpoint of block 0, mm outputs MUST_SAVE: h0 and g0 stay in the
# selective-checkpoint cache (outside autograd's saved tensors), m0 is recomputed from h0.
#   saved: h0, g0, o0, m1, o1 + loss = full checkpoint + 2A.
#   peak: at the same moment as without checkpointing, with h0, g0 in place of m0: h0, g0, o0,
#   m1, o1, dg1, dm1 and dW3.
#   (its peak comes before the recompute: one RNG state)
SAC_SAVED = 5 * A + LOSS + RNG
SAC_PEAK = 7 * A + W + LOSS + ONES + RNG


def test_plain_chain_exact_bytes():
    m = measure(two_blocks(), (batch(),))
    assert m.saved == PLAIN_SAVED
    assert m.peak == PLAIN_PEAK


def test_checkpoint_drops_saved_and_peak_by_exact_amounts():
    plain = measure(two_blocks(), (batch(),))
    ckpt = measure(FirstBlockCheckpointed(two_blocks()), (batch(),))
    assert ckpt.saved == CKPT_SAVED
    assert ckpt.peak == CKPT_PEAK
    assert plain.saved - ckpt.saved == A - RNG  # m0 is no longer held
    assert plain.peak - ckpt.peak == A - W - 2 * RNG  # 25 MiB -> 22 MiB


def test_selective_checkpoint_outputs_are_seen():
    """Selective checkpointing keeps mm outputs in its own cache, outside autograd's saved
    tensors: the tracker sees them (h0 and g0, two activations more than full checkpoint)."""
    full = measure(FirstBlockCheckpointed(two_blocks()), (batch(),))
    selective = measure(FirstBlockCheckpointed(two_blocks(), selective=True), (batch(),))
    assert selective.saved == SAC_SAVED
    assert selective.saved - full.saved == 2 * A
    assert selective.peak == SAC_PEAK


def test_wrapping_with_autoremat_apply_drops_saved_bytes():
    """autoremat's own wrapping of block "0" gives the same figures as checkpoint by hand."""
    model = two_blocks()
    before = measure(model, (batch(),))
    apply(model, ["0"])
    try:
        after = measure(model, (batch(),))
    finally:
        remove(model)
    assert before.saved == PLAIN_SAVED
    assert after.saved == CKPT_SAVED
    assert after.peak == CKPT_PEAK
    assert before.saved - after.saved == A - RNG


@pytest.mark.slow
def test_flops_are_exact_and_include_recompute():
    """Each forward mm is 2*M*N*K; backward computes the input gradient and the weight
    gradient, two mms of the same size, except for the first Linear whose input does not
    require grad (autograd skips that one)."""
    plain = measure(two_blocks(), (batch(),))
    assert plain.flops == 4 * UNIT + (2 * 4 - 1) * UNIT
    x = batch().requires_grad_()
    with_input_grad = measure(two_blocks(), (x,))
    assert with_input_grad.flops == 4 * UNIT + 2 * 4 * UNIT  # backward is twice the forward
    assert x.grad is None  # measure put the input's grad back too
    # full checkpoint recomputes block 0's two mms; selective keeps them, recomputes only ReLU
    assert measure(FirstBlockCheckpointed(two_blocks()), (batch(),)).flops == 13 * UNIT
    sac = FirstBlockCheckpointed(two_blocks(), selective=True)
    assert measure(sac, (batch(),)).flops == 11 * UNIT


def test_frozen_parameters():
    """Block 0 frozen: no crash (torch's MemTracker raises here), no gradient for it, and block
    0 keeps nothing for backward.

    saved: o0 (saved by block 1's first mm for dW2), m1, o1 + loss.
    peak: block 1's second Linear backward: o0, m1, o1, dg1, dm1, dW3 (afterwards ReluBackward
    gives o0, m1, o1, dW3, dm1, dh1, the same); no do0 is computed, so nothing more later.
    """
    model = two_blocks()
    model[0].requires_grad_(False)
    m = measure(model, (batch(),))
    assert m.saved == 3 * A + LOSS
    assert m.peak == 5 * A + W + LOSS + ONES
    assert all(p.grad is None for p in model.parameters())
    assert m.flops == 4 * UNIT + 3 * UNIT  # dW3, dm1, dW2; nothing into block 0


@pytest.mark.parametrize("kind", ["plain", "checkpoint", "selective"])
def test_meta_device_gives_the_same_bytes_as_cpu(kind):
    def build(device):
        blocks = two_blocks(device)
        if kind == "plain":
            return blocks
        return FirstBlockCheckpointed(blocks, selective=kind == "selective")

    cpu = measure(build("cpu"), (batch("cpu"),))
    meta = measure(build("meta"), (batch("meta"),))
    # (on meta no device keeps the checkpoint's RNG states: they are the CPU's memory)
    states = {"plain": (0, 0), "checkpoint": (2, 1), "selective": (1, 1)}[kind]
    assert (meta.peak + states[0] * RNG, meta.saved + states[1] * RNG, meta.flops) == (
        cpu.peak, cpu.saved, cpu.flops
    )


def test_checkpoint_recompute_peak_is_not_inflated_by_the_flop_counter():
    """measure takes memory and FLOPs from separate runs. FlopCounterMode's module tracker holds
    the autograd nodes of checkpoint recomputes (and their activations) until it exits; run
    together, this model would read 8 MiB instead of 7.

    Model: four Linear+ReLU blocks on 512 x 512 (every tensor 1 MiB), the first three under
    one checkpoint. Peak, in the recompute: o3 (output), da2, dW3, and the recomputed
    a0', a1', h2', a2' = 7 MiB, + loss + ones, and the two RNG states checkpoint keeps then.
    """

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(linear(), nn.ReLU()) for _ in range(4)])

        def forward(self, x):
            x = checkpoint(self.blocks[:3], x, use_reentrant=False)
            return self.blocks[3](x)

    m = measure(Chain(), (torch.randn(512, 512),))
    assert m.peak == 7 * MiB + LOSS + ONES + 2 * RNG
    assert m.saved == 2 * MiB + LOSS + RNG  # a2 (checkpoint output) and a3 (output)


def test_measure_leaves_the_model_as_found():
    """BatchNorm statistics, dropout's RNG draws, gradients, modes: all put back."""
    for name in ("cnn", "gpt2"):  # BatchNorm + dropout; dropout
        model, args, kwargs = EXAMPLES[name]()
        model.train()
        first = next(model.parameters())
        first.grad = torch.ones_like(first)
        grad_object = first.grad
        inner = next(m for m in model.modules() if m is not model)
        inner.eval()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        modes = [m.training for m in model.modules()]
        rng = torch.random.get_rng_state()
        m = measure(model, args, kwargs)
        assert m.peak >= m.saved > 0 and m.flops > 0
        assert first.grad is grad_object and torch.equal(first.grad, torch.ones_like(first))
        assert all(p.grad is None for p in model.parameters() if p is not first)
        for key, value in model.state_dict().items():
            assert torch.equal(value, state[key]), (name, key)
        assert [m.training for m in model.modules()] == modes
        assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.slow
def test_measure_is_deterministic_with_dropout():
    model, args, kwargs = EXAMPLES["gpt2"]()
    first = measure(model, args, kwargs)
    second = measure(model, args, kwargs)
    assert (first.peak, first.saved, first.flops) == (second.peak, second.saved, second.flops)


def test_live_memory_counts_gradients_made_in_backward():
    """The autograd engine runs CPU backward on the calling thread with the mode active: the
    weight gradient's storage is counted, and dropping it is seen."""
    lin = linear()
    x = torch.randn(512, 512)
    threads = set()

    def record_thread(grad):
        threads.add(threading.get_ident())

    lin.weight.register_hook(record_thread)
    with LiveMemory() as mem:
        out = lin(x)  # 1 MiB
        loss = out.sum()  # 4 B
        assert mem.snapshot("forward") == MiB + LOSS
        loss.backward()  # ones (4 B, freed at the end of backward) and dW (1 MiB)
        assert mem.current == 2 * MiB + LOSS
        assert mem.peak == 2 * MiB + LOSS + ONES
        lin.weight.grad = None
        assert mem.current == MiB + LOSS
    assert threads == {threading.get_ident()}
    assert mem.marks == {"forward": MiB + LOSS}


def test_live_memory_counts_each_storage_once_and_ignores_older_storages():
    old = torch.randn(256, 1024)  # 1 MiB, made before the mode
    with LiveMemory(trace=True) as mem:
        view = old[1:].t()  # a view of an older storage: nothing new
        old.mul_(2)  # in place on an older storage: nothing new
        torch.mul(old, 3, out=old)
        assert mem.current == 0
        new = old + 1  # 1 MiB
        views = [new[i] for i in range(4)] + [new.view(-1), new.t(), new.detach()]
        assert mem.current == MiB
        del new
        assert mem.current == MiB  # the views still hold the storage
        del views
        assert mem.current == 0
        const = torch.tensor([1.0, 2.0])  # made outside the dispatcher, lifted: 8 B
        assert mem.current == 8
        del const
    assert mem.peak == MiB and mem.allocated == MiB + 8
    assert mem.events[0] == ("aten.add.Tensor", MiB, MiB)
    assert view.shape == (1024, 255)


def test_live_memory_on_meta_tensors():
    with LiveMemory() as mem:
        a = torch.empty(512, 512, device="meta")
        b = a @ a
        c = torch.relu(b)
        assert mem.current == 3 * MiB
        del a, b
        assert mem.current == MiB
    assert mem.peak == 3 * MiB
    assert c.device.type == "meta"


def test_saved_tensors_freed_only_when_backward_releases_them():
    """A tensor held only by autograd (no Python reference) stays counted until backward."""
    x = torch.randn(512, 512, requires_grad=True)
    with LiveMemory() as mem:
        loss = x.exp().sum()  # exp saves its 1 MiB output; no Python name holds it
        assert mem.current == MiB + LOSS
        loss.backward()  # frees exp's output; leaves x.grad (1 MiB)
        assert mem.current == MiB + LOSS
        x.grad = None
        assert mem.current == LOSS


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None = None


def test_default_loss():
    t = torch.ones(2, 3)
    loss = torch.tensor(5.0)
    assert default_loss({"logits": t, "loss": loss}) is loss
    assert default_loss({"logits": t, "loss": None}).item() == 6.0
    assert default_loss(Output(t, (t,), loss)) is loss
    assert default_loss(Output(t, (t, 2 * t))).item() == 6.0 + 6.0 + 12.0
    half = torch.full((4,), 0.5, dtype=torch.float16)
    total = default_loss((t, half, torch.arange(3)))  # ints are skipped
    assert total.dtype == torch.float32 and total.item() == 6.0 + 2.0
    assert default_loss(t).item() == 6.0
    with pytest.raises(ValueError, match="no floating-point tensor"):
        default_loss((torch.arange(3), "text"))


def test_default_loss_on_a_hugging_face_output():
    transformers = pytest.importorskip("transformers")
    logits = torch.ones(2, 3)
    loss = torch.tensor(1.5)
    out = transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)
    assert default_loss(out) is loss
    no_loss = transformers.modeling_outputs.CausalLMOutput(logits=logits)
    assert default_loss(no_loss).item() == 6.0


def test_bad_losses_raise_value_errors():
    model = linear()
    x = torch.randn(4, 512)
    with pytest.raises(ValueError, match=r"shape \(4, 512\).*single number"):
        measure(model, (x,), loss_fn=lambda out: out)
    with pytest.raises(ValueError, match="not a tensor"):
        measure(model, (x,), loss_fn=lambda out: 1.0)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad"):
        measure(model, (x,))
    with pytest.raises(ValueError, match="repeats"):
        measure(model, (x,), repeats=0)
    with pytest.raises(TypeError):
        measure(lambda x: x, (x,))


def test_measurement_str_and_timing():
    m = measure(linear(), torch.randn(512, 512), repeats=3)
    assert isinstance(m, Measurement) and m.seconds > 0
    assert m.saved == MiB + LOSS and m.peak == 2 * MiB + LOSS + ONES
    text = str(m)
    assert "2.00 MiB" in text and "GFLOP" in text and "\n" not in text


def test_cuda_memory_figures_are_frozen_when_the_block_exits(monkeypatch):
    """``measure`` reads ``peak`` after its FLOP-counting and timing runs: the allocator's
    statistics must not leak those runs into the measurement (they did, on an H200: a budget
    plan's peak read 2515 MiB for a step that peaked at 1295 MiB). Faked allocator, no GPU."""
    from autoremat.record.memory import CudaMemory

    state = {"allocated": 100, "max": 100}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["max"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    with CudaMemory() as memory:
        state.update(allocated=130, max=160)
        assert (memory.current, memory.peak) == (30, 60)
    state.update(allocated=500, max=900)  # what runs after the block
    assert (memory.current, memory.peak) == (30, 60)
