"""Shared helpers: one training step, comparisons of two models after it, and the proof that
a wrapped model's entries were recomputed
(:class:`~autoremat.comparison.recomputed.RecomputeCounter`)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import fx, nn

from autoremat.comparison.recomputed import RecomputeCounter
from autoremat.core.nested import iter_tensors
from autoremat.examples import EXAMPLES
from autoremat.wrap.checkpointed import wrapped_paths

# No test may depend on timing: hypothesis's per-example deadline (200 ms by default) and its
# too-slow health check fail tests on a busy machine, so both are off for every property test.
settings.register_profile("autoremat", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("autoremat")

# `make test` runs the suite in two processes (pytest-xdist) on two cores: one intra-op thread
# each, or their threads spin waiting on each other (measured: 10-12 min where one process with
# two threads took 23; with two threads each, slower than one process: docs/benchmarks.md).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-recompute",
        action="store_true",
        help="checkpoint replaced by a plain call (nothing saved, nothing recomputed): every "
        "test that promises a recompute must then fail (docs/architecture.md, 'Tests that "
        "see a no-op')",
    )


def _plain_call(fn: Any, *args: Any, use_reentrant: Any = None, preserve_rng_state: Any = None,
                context_fn: Any = None, **kwargs: Any) -> Any:  # fmt: skip
    """``checkpoint``'s signature, a plain call: what a wrap that recomputes nothing does."""
    return fn(*args, **kwargs)


NO_RECOMPUTE = "AUTOREMAT_TEST_NO_RECOMPUTE"  # (set for the ranks a test starts too)


def no_recompute_if_asked() -> None:
    """In a process a test started (a rank), the same plain call when the test run was asked
    for ``--no-recompute``."""
    if os.environ.get(NO_RECOMPUTE) == "1":
        from autoremat.wrap import checkpointed

        checkpointed.checkpoint = _plain_call  # type: ignore[assignment]


def pytest_configure(config: pytest.Config) -> None:
    """With ``--no-recompute``, autoremat's checkpoint call is a plain call for the whole run,
    here and in the ranks a test starts."""
    if config.getoption("--no-recompute"):
        os.environ[NO_RECOMPUTE] = "1"
        no_recompute_if_asked()


def aot_eager_keeping_backward() -> tuple[Any, list[fx.Graph]]:
    """The ``aot_eager`` backend (dynamo, AOTAutograd, the min-cut partitioner, graphs run
    eagerly) that also keeps each backward graph it makes, for :func:`recomputed_regions`."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    graphs: list[fx.Graph] = []

    def keep(gm: fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm.graph)
        return boxed_nop(gm, inputs)

    return functools.partial(aot_eager, bw_compiler=keep), graphs


@contextlib.contextmanager
def inductor_keeping_backward() -> Iterator[list[fx.Graph]]:
    """Inside, inductor keeps each backward graph it compiles (after its own passes: a graph
    with ``tangents`` inputs), for :func:`recomputed_regions`; its graph cache is off."""
    graphs: list[fx.Graph] = []

    def keep(graph: fx.Graph) -> None:
        if any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
            graphs.append(graph)

    with torch._inductor.config.patch(post_grad_custom_post_pass=keep, fx_graph_cache=False):
        yield graphs


def recomputed_regions(backward: list[fx.Graph]) -> int:
    """How many checkpointed regions of a compiled step run forward ops again in its backward
    graphs: ops the partitioner was told to recompute (``must_recompute``), counted by region
    (``ac_graph_id``). A compiled step that recomputes nothing has none."""
    from torch._functorch.partitioners import must_recompute

    return len(
        {
            node.meta.get("ac_graph_id")
            for graph in backward
            for node in graph.nodes
            if node.op == "call_function" and must_recompute(node)
        }
    )


def loss_of(output: Any) -> torch.Tensor:
    """The output's loss if it has one, else a loss from every float tensor in it."""
    if isinstance(output, dict) and output.get("loss") is not None:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    floats = [t for _, t in iter_tensors(output) if t.is_floating_point()]
    assert floats, "the output holds no floating-point tensor"
    return sum(t.float().pow(2).mean() for t in floats)


def train_step(model: nn.Module, args: tuple, kwargs: dict, seed: int = 1) -> torch.Tensor:
    """Forward + backward from gradients None, with a fixed seed (dropout)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    return loss.detach()


def recomputed_step(model: nn.Module, step: Any, entries: Any = None) -> Any:
    """``step()``, asserting that every entry of ``model`` (``entries``, else every entry
    wrapped, :func:`autoremat.wrap.wrapped_paths`) ran ops in a recompute meanwhile."""
    with RecomputeCounter() as seen:
        result = step()
    seen.check(wrapped_paths(model) if entries is None else entries)
    return result


def _step_of(model: nn.Module, args: tuple, kwargs: dict, entries: Any) -> torch.Tensor:
    """:func:`train_step`; for a wrapped model (or given ``entries``), proving that they were
    recomputed in it (:func:`recomputed_step`)."""
    if entries is None and not wrapped_paths(model):
        return train_step(model, args, kwargs)  # a plain model: nothing to recompute
    return recomputed_step(model, lambda: train_step(model, args, kwargs), entries)


def assert_same_step(
    reference: nn.Module, wrapped: nn.Module, args: tuple, kwargs: dict, entries: Any = None
) -> None:
    """One step of each gives the same loss, gradients and buffers (tight tolerances), and the
    second model's entries (``entries``, else every entry wrapped; none for a plain model)
    were recomputed in its step."""
    loss_ref = train_step(reference, args, kwargs)
    loss_new = _step_of(wrapped, args, kwargs, entries)
    torch.testing.assert_close(loss_new, loss_ref, rtol=1e-6, atol=1e-7)
    grads = 0
    for (name, p), (name2, q) in zip(
        reference.named_parameters(), wrapped.named_parameters(), strict=True
    ):
        assert name == name2
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            grads += 1
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert grads > 0, "no parameter received a gradient: the comparison would be vacuous"
    for (name, b), (_, c) in zip(reference.named_buffers(), wrapped.named_buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=0, atol=0, msg=name)


def tiny_llama() -> tuple[nn.Module, torch.Tensor]:
    """A Hugging Face ``LlamaForCausalLM`` (3 layers, width 64, GQA 4/2 heads, attention
    dropout 0.1, training mode) and input ids (4 x 64), the same on every call; skips the
    test without transformers."""
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = t.LlamaConfig(
            num_hidden_layers=3,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=200,
            max_position_embeddings=128,
            attention_dropout=0.1,
        )
        model = t.LlamaForCausalLM(config).train()
        ids = torch.randint(0, 200, (4, 64))
    return model, ids


def under_autocast(name: str, batch: int = 2) -> tuple[nn.Module, tuple, dict]:
    """The example ``name`` at ``batch`` (its first rows), for the tests that run it under
    CPU autocast: bfloat16 and float16 CPU kernels are 70-100 times slower than float32 ones
    on a CPU without AVX-512 (docs/benchmarks.md), so a full-size example's real steps under
    autocast would be most of the suite's time."""
    from autoremat.training.scale_batch import scale_batch

    model, args, kwargs = EXAMPLES[name]()
    args, kwargs = scale_batch(args, kwargs, batch)
    return model, args, kwargs


@pytest.fixture(params=list(EXAMPLES))
def example(request: pytest.FixtureRequest) -> tuple[str, nn.Module, tuple, dict]:
    model, args, kwargs = EXAMPLES[request.param]()
    return request.param, model, args, kwargs


TINY = """
import torch
from torch import nn

def build():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)))
    return model, (torch.randn(256, 64, generator=g),), {}
"""


@pytest.fixture
def tiny(tmp_path):
    """A TARGET for a small model whose steps are quick: four Linear+GELU blocks."""
    file = tmp_path / "tiny.py"
    file.write_text(TINY)
    return f"{file}:build"
