"""Real training combinations (issue 5): mixed precision, torch.compile, Hugging Face
encoder-decoder models with caches, frozen models with LoRA-like adapters, saved-tensor hooks.

Every test compares one training step of the wrapped model with the same step of the unwrapped
model under the same setup, and proves that every entry was recomputed (a wrap that
recomputed nothing would pass the comparison). Where bitwise equality holds (it does for every
eager case here, bf16 autocast included) it is asserted as such.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointError

import autoremat
from conftest import recomputed_step, tiny_llama

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(
    model: nn.Module,
    forward: Callable[[nn.Module], torch.Tensor],
    around: Callable[[], Any] = contextlib.nullcontext,
    seed: int = 1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None], dict[str, torch.Tensor]]:
    """Loss, gradients and buffers after forward + backward (both inside ``around()``)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with around():
        loss = forward(model)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _assert_identical(
    reference: nn.Module,
    wrapped: nn.Module,
    forward: Callable[[nn.Module], torch.Tensor],
    around: Callable[[], Any] = contextlib.nullcontext,
    *,
    reference_forward: Callable[[nn.Module], torch.Tensor] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> int:
    """The two models' steps give equal loss, gradients and buffers: bitwise by default, else
    within ``rtol``/``atol`` (buffers always bitwise), and every entry of ``wrapped`` was
    recomputed in its step. Returns the number of parameters that received a gradient
    (asserted > 0)."""
    loss_ref, grads_ref, buffers_ref = _step(reference, reference_forward or forward, around)
    loss, grads, buffers = recomputed_step(wrapped, lambda: _step(wrapped, forward, around))
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=atol)
    assert grads.keys() == grads_ref.keys()
    trained = 0
    for name, g in grads.items():
        r = grads_ref[name]
        assert (g is None) == (r is None), name
        if g is not None:
            trained += 1
            torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=name)
    assert trained > 0, "no parameter received a gradient: the comparison would be vacuous"
    for name, b in buffers.items():
        assert torch.equal(b, buffers_ref[name]), name
    return trained


# --- 1. mixed precision --------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class AutocastInside(Block):
    """A block whose forward itself enters bf16 autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return super().forward(x)


class FP32Island(nn.Module):
    """Runs its block with autocast disabled (an fp32 island inside a bf16 region)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = Block(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.block(x.float())


class Net(nn.Module):
    def __init__(self, kinds: list[type[nn.Module]], width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([kind(width) for kind in kinds])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).float().flatten(0, 1), y.flatten())


def _bf16() -> Any:
    return torch.autocast("cpu", dtype=BF16)


def _record_fc1_dtypes(model: Net) -> list[list[torch.dtype]]:
    """Per block, the dtype of each output of its ``fc1`` (forward, then any recompute)."""
    seen: list[list[torch.dtype]] = []
    for block in model.blocks:
        fc1 = block.block.fc1 if isinstance(block, FP32Island) else block.fc1
        seen.append([])
        fc1.register_forward_hook(lambda m, i, out, log=seen[-1]: log.append(out.dtype))
    return seen


AMP_CASES = {
    # name: blocks, the context of forward + backward, the context of forward only,
    # the dtype each block's fc1 computes in
    "autocast-around-whole-step": ([Block] * 3, _bf16, contextlib.nullcontext, [BF16] * 3),
    "autocast-around-forward-only": ([Block] * 3, contextlib.nullcontext, _bf16, [BF16] * 3),
    "autocast-inside-the-module": (
        [Block, AutocastInside, Block],
        contextlib.nullcontext,
        contextlib.nullcontext,
        [torch.float32, BF16, torch.float32],
    ),
    "autocast-disabled-around-the-module": (
        [Block, FP32Island, Block],
        contextlib.nullcontext,
        _bf16,
        [BF16, torch.float32, BF16],
    ),
}


@pytest.mark.parametrize("case", list(AMP_CASES))
def test_mixed_precision_is_bitwise_identical_and_recomputes_in_the_forward_dtype(case):
    """bf16 autocast around the whole step, around the forward only (backward, hence the
    recompute, outside autocast), inside a wrapped module, and disabled around a wrapped
    module: the wrapped step equals the unwrapped step with the same autocast setup bit for
    bit, and every recompute runs in the dtype its forward ran in (checkpoint replays the
    forward's autocast state)."""
    kinds, whole, forward_only, dtypes = AMP_CASES[case]
    torch.manual_seed(0)
    reference = Net(kinds).train()
    x, y = torch.randn(32, 16, 8), torch.randint(0, 4, (32, 16))
    model = copy.deepcopy(reference)
    with forward_only():
        plan = autoremat.plan(model, (x, y), segments=3)
    plan.apply(model)
    assert any(p == "blocks.1" or p.startswith("blocks.1.") for p in plan.modules), plan.modules
    seen_ref, seen = _record_fc1_dtypes(reference), _record_fc1_dtypes(model)

    def forward(m: nn.Module) -> torch.Tensor:
        with forward_only():
            return m(x, y)

    _assert_identical(reference, model, forward, whole)
    assert [set(d) for d in seen_ref] == [{d} for d in dtypes]
    assert [set(d) for d in seen] == [{d} for d in dtypes]  # forward and recompute alike
    assert len(seen[1]) == 2 * len(seen_ref[1]), "block 1 was not recomputed"


def test_autocast_on_a_hugging_face_llama_is_bitwise_identical():
    """A tiny Llama (dropout in attention) under bf16 autocast, plan made under autocast."""
    reference, ids = tiny_llama()
    model = copy.deepcopy(reference)
    kwargs = {"input_ids": ids, "labels": ids}
    with _bf16():
        autoremat.plan(model, (), kwargs, budget="50%").apply(model)
    assert autoremat.wrap.wrapped_paths(model)
    dtypes: list[torch.dtype] = []
    model.model.layers[0].mlp.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))

    def forward(m: nn.Module) -> torch.Tensor:
        with _bf16():
            return m(**kwargs).loss

    _assert_identical(reference, model, forward)
    assert dtypes and set(dtypes) == {BF16}


# --- 2. torch.compile -----------------------------------------------------------------------


class TanhBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TinyChain(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(TanhBlock(width), TanhBlock(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).pow(2).mean()


def _saved_bytes_and_step(model: nn.Module, x: torch.Tensor) -> tuple[int, tuple]:
    """Bytes autograd saves for backward in the forward (``saved_tensors_hooks``, which also
    fire for a compiled graph), and the step's loss and gradients."""
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    loss.backward()
    return saved, (loss.detach(), [p.grad.clone() for p in model.parameters()])


@pytest.mark.slow
def test_torch_compile_traces_the_wrapper_in_one_graph_and_keeps_the_plan():
    """``torch.compile`` of a wrapped model (backend ``aot_eager``: dynamo, AOTAutograd and the
    min-cut partitioner inductor uses, without inductor's tens-of-seconds cold compile): one
    graph, no graph break, one ``tag_activation_checkpoint`` region per plan entry; the
    partitioner recomputes them, so the compiled step saves about a quarter of what the
    compiled unwrapped model saves (50816 vs 193600 bytes) and about what the eager wrapped
    model saves (50240); loss and gradients are bitwise equal to eager, wrapped or not.
    (With inductor: the same graph and bytes, gradients within 4e-8 of eager, cold compile
    about 30 s on this CPU.)"""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    reference = TinyChain()
    x = torch.randn(256, 16)
    model = copy.deepcopy(reference)
    plan = autoremat.plan(model, (x,), segments=2)
    assert plan.modules == ("blocks.0", "blocks.1")
    plan.apply(model)

    counter = CompileCounterWithBackend("aot_eager")
    saved_compiled, step_compiled = _saved_bytes_and_step(
        torch.compile(model, backend=counter, fullgraph=True), x
    )
    assert counter.frame_count == 1  # one graph: fullgraph=True would raise on a break
    regions = [
        node
        for node in counter.graphs[0].graph.nodes
        if node.target is torch.ops.higher_order.tag_activation_checkpoint
    ]
    assert len(regions) == len(plan.modules)

    saved_compiled_ref, step_compiled_ref = _saved_bytes_and_step(
        torch.compile(copy.deepcopy(reference), backend="aot_eager"), x
    )
    saved_eager_ref, step_eager_ref = _saved_bytes_and_step(reference, x)
    saved_eager, step_eager = _saved_bytes_and_step(model, x)

    for step in (step_compiled, step_compiled_ref, step_eager):
        assert torch.equal(step[0], step_eager_ref[0])
        assert all(map(torch.equal, step[1], step_eager_ref[1]))
    assert saved_eager < saved_eager_ref / 4
    assert saved_compiled < saved_compiled_ref / 3
    assert saved_eager <= saved_compiled <= 1.1 * saved_eager


# --- 3. Hugging Face encoder-decoder models with caches --------------------------------------


def _transformers() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _t5() -> nn.Module:
    t = _transformers()
    config = t.T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return t.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    t = _transformers()
    config = t.BartConfig(
        vocab_size=100,
        d_model=32,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
    )
    return t.BartForConditionalGeneration(config)


SEQ2SEQ = {"t5": _t5, "bart": _bart}


def _seq2seq(name: str) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    """A tiny model in training mode, with ``use_cache`` at its default (True), and inputs
    without ``labels`` (BART turns the cache off itself when given labels; T5 does not)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SEQ2SEQ[name]().train()
        kwargs = {
            "input_ids": torch.randint(1, 100, (4, 48)),
            "decoder_input_ids": torch.randint(1, 100, (4, 40)),
        }
        labels = torch.randint(1, 100, (4, 40))
    assert model.config.use_cache is True
    return model, kwargs, labels


def _cache_of(output: Any) -> Any:
    return output.get("cache", output.get("past_key_values"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [{"segments": 3}, {"budget": "50%"}, {"segments": 1}, {"segments": 0}],
    ids=["segments3", "budget50", "stacks", "root"],
)
@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_encoder_decoder_with_cache_and_dropout_trains_identically(name, how):
    """T5 and BART with ``use_cache=True`` (their default), dropout on: unwrapped, the decoder
    stack builds an ``EncoderDecoderCache`` in training; wrapped, autoremat's pre-hook on the
    top model (and on each stack) calls it with ``use_cache=False``, so no cache reaches the
    recomputed layers, and the step is bitwise equal to the unwrapped one. ``stacks`` and
    ``root`` wrap modules that return a ``ModelOutput``."""
    model, kwargs, labels = _seq2seq(name)
    reference = copy.deepcopy(model)

    def lm_loss(output: Any) -> torch.Tensor:
        return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())

    plan = autoremat.plan(model, (), kwargs, loss_fn=lm_loss, **how)
    assert plan.modules
    assert any("decoder" in p for p in plan.modules) or plan.modules == ("",)
    plan.apply(model)
    outputs: list[Any] = []
    for path in plan.modules:
        model.get_submodule(path).register_forward_hook(lambda m, i, out: outputs.append(out))

    def forward(m: nn.Module) -> torch.Tensor:
        return lm_loss(m(**kwargs))

    def forward_without_cache(m: nn.Module) -> torch.Tensor:
        return lm_loss(m(**kwargs, use_cache=False))

    # bitwise equal to the unwrapped model without its cache ...
    _assert_identical(reference, model, forward, reference_forward=forward_without_cache)
    # ... and, loss bitwise, gradients to 1.1e-8, to the unwrapped model with its cache: HF's
    # cached attention path itself rounds differently
    _assert_identical(reference, model, forward, rtol=1e-6, atol=1e-7)
    assert torch.equal(_step(reference, forward)[0], _step(model, forward)[0])

    transformers = _transformers()
    if how in ({"segments": 1}, {"segments": 0}):
        assert outputs and all(isinstance(o, transformers.utils.ModelOutput) for o in outputs)
    assert isinstance(_cache_of(reference(**kwargs)), transformers.EncoderDecoderCache)
    assert _cache_of(model(**kwargs)) is None
    with torch.no_grad():  # inference keeps its cache
        assert isinstance(_cache_of(model(**kwargs)), transformers.EncoderDecoderCache)


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_encoder_decoder_with_the_cache_hook_removed_fails_clearly(name):
    """Why the pre-hook matters (and a regression test for the check that the wrapped
    forward's inputs did not change): without the hook, the decoder layers' recompute would
    see an ``EncoderDecoderCache`` their forward already filled. autoremat raises its own
    error naming the layer and the cache (before: torch's "A different number of tensors was
    saved", the input check did not look deep enough to reach the cache's tensors)."""
    model, kwargs, labels = _seq2seq(name)
    autoremat.plan(model, (), kwargs, segments=3).apply(model)
    autoremat.core.huggingface.remove_cache_hooks(model)  # the top model's hook, and the stacks'
    loss = F.cross_entropy(model(**kwargs).logits.flatten(0, 1), labels.flatten())
    with pytest.raises(CheckpointError, match=r"decoder\.(block|layers)\.2'.*\['cache'\]"):
        loss.backward()


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_an_explicit_cache_object_in_training_fails_clearly(name):
    """A cache object passed in by the user is still filled (``use_cache=False`` does not
    stop a given cache): autoremat names the layer instead of torch's unclear error."""
    model, kwargs, labels = _seq2seq(name)
    autoremat.plan(model, (), kwargs, segments=3).apply(model)
    t = _transformers()
    cache = t.EncoderDecoderCache(
        t.DynamicCache(config=model.config), t.DynamicCache(config=model.config)
    )
    params = inspect.signature(type(model).forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    output = model(**kwargs, **{key: cache})
    loss = F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())
    with pytest.raises(CheckpointError, match=r"recomputed in backward.*<EncoderDecoderCache>"):
        loss.backward()


# --- 4. frozen model, LoRA-like adapters ------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update (both factors random, so both get
    non-zero gradients)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


@pytest.mark.parametrize("how", [{"segments": 3}, {"budget": "50%"}], ids=["segments", "budget"])
@pytest.mark.parametrize("trainable", ["q_proj", "lora"])
def test_frozen_llama_with_adapters_trains_identically(trainable, how):
    """Everything frozen (embedding included, so no input of the first layer requires grad),
    only the ``q_proj`` weights or LoRA factors on ``q_proj``/``v_proj`` train: gradients are
    bitwise equal to the unwrapped model's, non-zero on every trainable parameter, None on
    every frozen one."""
    model, ids = tiny_llama()
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for layer in model.model.layers:
            attn = layer.self_attn
            if trainable == "q_proj":
                attn.q_proj.weight.requires_grad_(True)
            else:
                attn.q_proj, attn.v_proj = LoRALinear(attn.q_proj), LoRALinear(attn.v_proj)
    reference = copy.deepcopy(model)
    kwargs = {"input_ids": ids, "labels": ids}
    plan = autoremat.plan(model, (), kwargs, **how)
    plan.apply(model)
    assert any(p.startswith("model.layers.0") for p in plan.modules), plan.modules

    trained = _assert_identical(reference, model, lambda m: m(**kwargs).loss)
    assert trained == (3 if trainable == "q_proj" else 12)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


# --- saved-tensor hooks (offloading) ----------------------------------------------------------


def test_save_on_cpu_and_other_saved_tensor_hooks_around_a_wrapped_model():
    """Regression: under ``torch.autograd.graph.save_on_cpu()`` (or any ``saved_tensors_hooks``)
    checkpoint gives the recompute other tensor objects than the forward's inputs; the wrapper
    took that for an in-place change and raised. Now the step equals the unwrapped one under
    the same hooks."""
    torch.manual_seed(0)
    reference = Net([Block, Block]).train()
    x, y = torch.randn(8, 16, 8), torch.randint(0, 4, (8, 16))
    model = copy.deepcopy(reference)
    autoremat.plan(model, (x, y), segments=2).apply(model)
    _assert_identical(reference, model, lambda m: m(x, y), torch.autograd.graph.save_on_cpu)

    def copying_hooks() -> Any:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)

    _assert_identical(reference, model, lambda m: m(x, y), copying_hooks)


def test_a_positional_input_changed_in_place_is_caught_and_named():
    """A positional input changed in place after the forward fails as the module's backward
    begins, naming the module and the fix (checkpoint's own check, later, names none); under
    saved-tensor hooks that pack a copy (see the test above) it is left to checkpoint, whose
    recompute then gets the copy."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    autoremat.wrap.apply(model, ["1"])
    h = model[0](torch.randn(2, 4))
    out = model[1](h)
    h.mul_(2)
    with pytest.raises(CheckpointError, match=r"module '1'.*args\[0\].*Fix: leave '1' out"):
        out.sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        h = model[0](torch.randn(2, 4))
        out = model[1](h)
    h.mul_(2)
    out.sum().backward()  # the recompute got the copy: no error


# --- models that checkpoint themselves --------------------------------------------------------


class TimmLike(nn.Module):
    """Blocks that checkpoint themselves when ``grad_checkpointing`` is on, as timm's models do
    after ``set_grad_checkpointing(True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*(Block(32) for _ in range(3)))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x).float().pow(2).mean()


def _self_checkpointing(kind: str) -> tuple[nn.Module, dict[str, Any], Any]:
    """A model with its own activation checkpointing on, its inputs and its loss."""
    if kind == "transformers":
        model, ids = tiny_llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss
    torch.manual_seed(0)
    model = TimmLike().train()
    model.grad_checkpointing = True
    return model, {"x": torch.randn(16, 8, 32)}, lambda out: out


def _own(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if getattr(m, "gradient_checkpointing", None)
            is True or getattr(m, "grad_checkpointing", None) is True]  # fmt: skip


@pytest.mark.parametrize("kind", ["transformers", "timm-like"])
def test_a_model_that_checkpoints_itself_is_planned_with_it_off(kind, caplog):
    """Its own checkpointing is off for the profile (the same profile as the plain model's, not
    a KeyError), off while the plan is applied (one warning each time), back on after
    ``remove`` and in a pickle (which holds the model as it was); the planned model trains as
    the model did with its own checkpointing, every entry recomputed."""
    model, kwargs, loss = _self_checkpointing(kind)
    on = _own(model)
    assert on
    reference = copy.deepcopy(model)
    with _switched(copy.deepcopy(model), False) as plain:
        expected = autoremat.profile(plain, (), kwargs, loss_fn=loss)
    with caplog.at_level(logging.WARNING, logger="autoremat"):
        got = autoremat.profile(model, (), kwargs, loss_fn=loss)
        plan = autoremat.plan(model, (), kwargs, loss_fn=loss, budget="60%", objective="flops")
        plan.apply(model)
    assert got.peak == expected.peak and _own(model) == []
    assert sum("checkpoints itself" in r.getMessage() for r in caplog.records) >= 2
    if kind != "transformers":  # (transformers' own switch adds a hook no pickle can hold)
        assert _own(pickle.loads(pickle.dumps(model))) == on
    assert _own(copy.deepcopy(model)) == []  # a copy is wrapped as the original
    _assert_identical(reference, model, lambda m: loss(m(**kwargs)))
    autoremat.remove(model)
    assert _own(model) == on


class Forwarding(nn.Module):
    """A wrapper that answers unknown attributes with its model's, as peft's ``PeftModel``
    does (``peft_model.grad_checkpointing`` is the timm model's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def test_a_switch_forwarded_by_a_wrapper_is_switched_where_it_lives():
    """Only the module that holds the switch is switched: planning a peft-like wrapper left a
    new ``grad_checkpointing`` attribute on the wrapper (the model changed by planning)."""
    model, kwargs, loss = _self_checkpointing("timm-like")
    wrapper = Forwarding(model)
    assert wrapper.grad_checkpointing is True  # forwarded
    autoremat.plan(wrapper, (), kwargs, loss_fn=loss, budget="60%", objective="flops")
    assert "grad_checkpointing" not in vars(wrapper)
    assert vars(model)["grad_checkpointing"] is True


@contextlib.contextmanager
def _switched(model: nn.Module, value: bool) -> Any:
    for _, m in model.named_modules():
        for name in ("gradient_checkpointing", "grad_checkpointing"):
            if isinstance(getattr(m, name, None), bool):
                setattr(m, name, value)
    yield model
