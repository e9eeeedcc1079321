"""Recording one training step: what each module saved, ran, held and when.

:func:`record_step` runs forward, loss and backward once, without recompute, under the live
memory tracker (:class:`~autoremat.record.memory.LiveMemory`), a dispatch mode that attributes every
forward op to the innermost running module (:class:`OpCosts`), saved-tensor hooks and module
hooks. It returns the raw facts as a :class:`Recording`; :mod:`autoremat.costs.model` derives
the cost model from them. Nothing here knows of plans, solvers or wraps.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from autoremat.core.entries import call_entry
from autoremat.core.huggingface import (
    cache_off_in_training,
    mask_answers,
    ordinary_positions_on_meta,
)
from autoremat.core.nested import iter_tensors, storage_key
from autoremat.core.progress import Progress
from autoremat.core.selective import WAYS, keeps, resolve
from autoremat.record.kept_outputs import KeptOutputs
from autoremat.record.memory import LiveMemory
from autoremat.record.snapshot import preserved
from autoremat.record.step import Autocast, LossFn, leaf_inputs, train_step
from autoremat.record.tree import Node, TensorInfo, tensor_infos

__all__ = [
    "Event",
    "Kept",
    "OpCosts",
    "OwnOps",
    "Recording",
    "SelfCheckpointingError",
    "new_storages",
    "record_step",
]

# (kind, node, peak since the previous event, live bytes now); kind is "start" or "end" of a
# module's forward, "backward" when its backward began, "unpack" when backward first used what
# it saved (or had used a cast it saved), "loss" when the forward ended, "done"
Event = tuple[str, Node, int, int]


@dataclass
class Kept:
    """What the ops one way of selective recompute keeps cost, for one module."""

    flops: int = 0
    written: int = 0
    # the storages it keeps: storage key -> bytes
    storages: dict[int, int] = field(default_factory=dict)


@dataclass
class OwnOps:
    """What the ops a module ran itself (not in a child) cost, for one module."""

    flops: int = 0
    written: int = 0
    ops: int = 0
    kept: dict[str, Kept] = field(default_factory=lambda: {w: Kept() for w in WAYS})


@dataclass
class Recording:
    """The facts of one recorded step (see the module docstring), by call: ``tree`` is the
    tree of the step's calls (each node one call of a module, a :class:`~autoremat.record.tree.Node`
    with ``call`` set when its module ran several times), and every dictionary below is keyed
    by its nodes (the nodes themselves: a node's ``path`` is its name in the profile, set when
    the step is done).

    ``savers``: storage key -> (bytes, the innermost modules that saved it for backward);
    ``input_keys``/``output_keys``: the new storages each module took in and gave out;
    ``born``: a kept output's storage key -> the event count when it was made; ``last_save``:
    module -> (event count, peak then) at its forward's last save; ``unpacked``: module ->
    (order, live bytes) when backward first used what it saved.
    """

    tree: Node
    events: list[Event] = field(default_factory=list)
    own_saved: dict[Node, int] = field(default_factory=lambda: defaultdict(int))
    own_ops: dict[Node, OwnOps] = field(default_factory=lambda: defaultdict(OwnOps))
    savers: dict[int, tuple[int, set[Node]]] = field(default_factory=dict)
    input_keys: dict[Node, dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    output_keys: dict[Node, set[int]] = field(default_factory=lambda: defaultdict(set))
    born: dict[int, int] = field(default_factory=dict)
    last_save: dict[Node, tuple[int, int]] = field(default_factory=dict)
    unpacked: dict[Node, tuple[int, int]] = field(default_factory=dict)
    # changed, kept_freed (and born): the kept outputs' facts, as KeptOutputs
    # (autoremat.record.kept_outputs) notes them
    changed: set[int] = field(default_factory=set)
    # the index of the "unpack" event marked when backward first used what a node saved
    unpack_events: dict[Node, int] = field(default_factory=dict)
    # the storage keys of the casts autocast's cache keeps until the forward's region ends
    # (OpCosts._cached), whoever saved them: a checkpointed module does not free them sooner
    cached_casts: set[int] = field(default_factory=set)
    kept_freed: dict[int, int] = field(default_factory=dict)
    # what Hugging Face's mask code decided reading the step's values, in order
    # (:func:`~autoremat.core.huggingface.mask_answers`), for a step without values to repeat
    mask_answers: list[bool] = field(default_factory=list)

    @functools.cached_property
    def family(self) -> tuple[dict[Node, Node | None], dict[Node, int]]:
        """Each node's parent (``None`` for the root) and depth, worked out once."""
        parent: dict[Node, Node | None] = {self.tree: None}
        depth: dict[Node, int] = {self.tree: 0}
        for node in self.tree.walk():
            for child in node.children:
                parent[child] = node
                depth[child] = depth[node] + 1
        return parent, depth

    def within(self, inner: Node, outer: Node) -> bool:
        """Whether node ``inner`` is ``outer`` or a node of its subtree."""
        parent, depth = self.family
        while depth[inner] > depth[outer]:
            inner = parent[inner]  # type: ignore[assignment]
        return inner is outer


class OpCosts(TorchDispatchMode):
    """Adds each forward op's FLOPs (``torch.utils.flop_counter`` formulas) and the bytes of
    the new storages it wrote to the running module, and apart, for each way of selective
    recompute, those of the ops whose outputs it keeps."""

    def __init__(self, stack: list[Node], own: dict[Node, OwnOps], clock: Callable[[], int],
                 preexisting: frozenset[int], cast_dtype: torch.dtype | None) -> None:  # fmt: skip
        super().__init__()
        self.stack = stack
        self.own = own
        self.preexisting = preexisting  # storage keys of parameters, buffers and inputs
        self.cast_dtype = cast_dtype  # the autocast's lower precision (None: no autocast)
        self.cached: set[int] = set()  # storage keys of the casts autocast's cache keeps
        self.kept = KeptOutputs(clock)
        self.counting = True
        self.keep = {way: resolve(ops) for way, ops in WAYS.items()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.counting:
            return func(*args, **kwargs)
        ways = [way for way, packets in self.keep.items() if keeps(func, args, kwargs, packets)]
        out = func(*args, **kwargs)
        own = self.own[self.stack[-1]]
        if func._schema.is_mutable:
            self.kept.changes(func, args, kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        seen = {storage_key(t) for _, t in iter_tensors((args, kwargs))}
        new = new_storages(seen, out)
        if func is torch.ops.aten._to_copy.default and self._cached(args, kwargs, seen):
            self.cached.update(new)
        written = sum(new.values())
        own.flops += flops
        own.written += written
        own.ops += 1
        if ways:
            self.kept.made(new)
            for way in ways:
                kept = own.kept[way]
                kept.flops += flops
                kept.written += written
                kept.storages.update(new)
            self.kept.watch(out, set(new))
        return out

    def _cached(self, args: Any, kwargs: Any, seen: set[int | None]) -> bool:
        """Whether this ``_to_copy`` (its inputs' storages ``seen``) is one autocast's cast
        cache keeps until its region ends: of a parameter, buffer or input, a float32 leaf
        that requires grad, not a view, cast to the autocast's lower precision (``cached_cast``
        in ATen's ``autocast_mode.h``; :class:`MetaAutocast` on ``meta``)."""
        source = args[0] if args else None
        return (
            not self.preexisting.isdisjoint(seen)
            and self.cast_dtype is not None
            and kwargs.get("dtype") == self.cast_dtype
            and isinstance(source, torch.Tensor)
            and source.is_leaf
            and source.requires_grad
            and source.dtype == torch.float32
            and not source._is_view()
        )


def new_storages(seen: Collection[int | None], out: Any) -> dict[int, int]:
    """The storages an op's outputs hold that its inputs (``seen``: their storage keys) did
    not: key -> bytes, in order."""
    new: dict[int, int] = {}
    for _, t in iter_tensors(out):
        key = storage_key(t)
        if key is not None and key not in seen and key not in new:
            new[key] = t.untyped_storage().nbytes()
    return new


class _Recorder:
    """The hooks of one recorded step, writing into one :class:`Recording`. Every call of a
    module is a node of its own (``path@k`` while recording; :meth:`finish` names those of
    modules that ran once by their path); its parent is the call that was running when it
    began. The root's first call is made before the step, so that what runs outside the
    model's forward (the loss) is the root's."""

    def __init__(
        self, model: nn.Module, tree: Node, inputs: list[torch.Tensor], dtype: torch.dtype | None
    ) -> None:
        self.root = _call_of(tree, 0)
        self.stack: list[Node] = [self.root]
        cpu = next((t.device.type == "cpu" for t in (*model.parameters(), *inputs)), True)
        self.memory = LiveMemory(rng_states=cpu)  # (the model's own checkpoints' RNG states)
        self.parent: dict[Node, Node | None] = {self.root: None}
        # grad_fns whose post-hook marks when they have run, by id
        self.hooked: dict[int, Any] = {}
        self.modules = {id(n.module): n for n in tree.walk()}
        self.count: dict[int, int] = defaultdict(int)
        self.preexisting = frozenset(
            key
            for t in [*model.parameters(), *model.buffers(), *inputs]
            if (key := storage_key(t)) is not None
        )
        self.handles: list[Any] = []  # of the hooks, removed after the step
        self.progress = Progress("profiling", sum(n.calls for n in tree.walk()), "module calls")
        self.costs = OpCosts(
            self.stack, defaultdict(OwnOps), lambda: len(self.rec.events), self.preexisting, dtype
        )
        self.rec = Recording(
            tree=self.root,
            own_ops=self.costs.own,
            born=self.costs.kept.born,
            changed=self.costs.kept.changed,
            cached_casts=self.costs.cached,
            kept_freed=self.costs.kept.freed,
        )

    def mark(self, kind: str, node: Node) -> None:
        self.rec.events.append((kind, node, self.memory.peak, self.memory.current))
        self.memory.reset_peak()

    def pack(self, t: torch.Tensor) -> tuple[Node, torch.Tensor]:
        rec, here = self.rec, self.stack[-1]
        if self.costs.counting:
            node: Node | None = here
            while node is not None:
                rec.last_save[node] = (len(rec.events), self.memory.peak)
                node = self.parent[node]
        key = storage_key(t)
        if key is not None and key not in self.preexisting:
            if key not in rec.savers:
                rec.savers[key] = (t.untyped_storage().nbytes(), set())
                rec.own_saved[here] += rec.savers[key][0]
            rec.savers[key][1].add(here)
        return here, t

    def unpack(self, packed: tuple[Node, torch.Tensor]) -> torch.Tensor:
        rec, saver = self.rec, packed[0]
        if saver not in rec.unpacked:
            self.mark("unpack", saver)
        here: Node | None = saver
        while here is not None and here not in rec.unpacked:
            rec.unpacked[here] = (len(rec.unpacked), self.memory.current)
            rec.unpack_events[here] = len(rec.events) - 1
            here = self.parent[here]
        self._used(saver)
        return packed[1]

    def _used(self, saver: Node) -> None:
        """Backward's grad_fn of ``saver`` uses what it saved: mark when it has run (it lets
        what it saved go then), once per grad_fn."""
        grad_fn = torch._C._current_autograd_node()
        if grad_fn is None:  # not in a grad_fn: the stretch that begins now holds it
            self.mark("unpack", saver)
            return
        at = id(grad_fn)
        if self.hooked.get(at) is grad_fn:
            return
        self.hooked[at] = grad_fn  # (until it has run: ids are reused)

        def ran(_grad_inputs: Any, _grad_outputs: Any) -> None:
            self.hooked.pop(at, None)
            self.mark("unpack", saver)

        grad_fn.register_hook(ran)

    def enter(self, module: nn.Module, a: Any, kw: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # a forward during backward: recomputed
            path = self.modules[id(module)].path
            raise SelfCheckpointingError(
                f"module {path or '(root)'!r} ran its forward during backward: the model "
                f"recomputes it itself (its own activation checkpointing, a "
                f"torch.utils.checkpoint call in a forward) with no switch autoremat knows, so "
                f"its step cannot be profiled. Turn the model's own checkpointing off before "
                f"planning (autoremat's plan replaces it): transformers "
                f"model.gradient_checkpointing_disable(), diffusers "
                f"disable_gradient_checkpointing(), timm set_grad_checkpointing(False), or a "
                f"flag of your own code"
            )
        k = self.count[id(module)]
        self.count[id(module)] += 1
        inputs = tuple(tensor_infos(a, "args") + tensor_infos(kw, "kwargs"))
        if module is self.root.module and k == 0:
            call = self.root
            call.inputs = inputs
        else:
            call = _call_of(self.modules[id(module)], k, inputs)
            self.parent[call] = caller = self.stack[-1]
            caller.children.append(call)
        self.mark("start", call)
        self.stack.append(call)
        self.rec.input_keys[call] = new_storages(self.preexisting, (a, kw))

    def leave(self, module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        call = self.stack.pop()
        call.outputs = tuple(tensor_infos(out, "out"))
        self.mark("end", call)
        self.progress.step()
        tensors = [t for _, t in iter_tensors(out)]
        self.rec.output_keys[call].update(k for t in tensors if (k := storage_key(t)) is not None)
        needs_grad = [t for t in tensors if t.requires_grad]
        if needs_grad:
            self.handles.append(
                torch.autograd.graph.register_multi_grad_hook(
                    needs_grad, lambda _g, c=call: self.mark("backward", c), mode="any"
                )
            )

    def after_forward(self) -> None:
        self.costs.counting = False
        self.mark("loss", self.root)

    def finish(self) -> Recording:
        """The recording, the calls of modules that ran once named by their path."""
        self.mark("done", self.root)
        for call in self.root.walk():
            call.calls = self.count[id(call.module)]
            if call.calls == 1:
                call.path, call.call = call.module_path, None
        return self.rec


class SelfCheckpointingError(ValueError):
    """The model recomputes a module itself, in backward, with no switch autoremat knows (its
    own call of ``torch.utils.checkpoint``): it cannot be profiled as it stands."""


def _call_of(node: Node, k: int, inputs: tuple[TensorInfo, ...] = ()) -> Node:
    """A node, with no children yet, for the ``k``-th call of ``node``'s module (``path@k``)."""
    return replace(
        node, path=call_entry(node.path, k), children=[], call=k, calls=0, inputs=inputs,
        outputs=(),
    )  # fmt: skip


def record_step(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None,
    tree: Node,
    loss_fn: LossFn | None,
    meta: bool,
    autocast: Autocast | None = None,
    hf_cache: bool = False,
) -> Recording:
    """Run one training step of ``model`` (see :func:`autoremat.record.step.train_step`) and record
    it (module docstring); ``tree`` is the module tree (:func:`autoremat.record.tree.build_tree`),
    the recording's tree the step's calls. Hugging Face caches are off in training, as once
    wrapped (on ``meta`` too: :func:`~autoremat.core.huggingface.ordinary_positions_on_meta`),
    unless ``hf_cache``. The model is left as it was found."""
    dtype = autocast[1] if autocast is not None else None
    rec = _Recorder(model, tree, [t for _, t in iter_tensors((args, kwargs))], dtype)
    positions = ordinary_positions_on_meta() if meta else contextlib.nullcontext()
    cache_off = contextlib.nullcontext() if hf_cache else cache_off_in_training(model)
    saved = torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack)
    try:
        with preserved(model, leaf_inputs(args, kwargs)), cache_off, positions:
            for m in (n.module for n in rec.modules.values()):
                rec.handles.append(m.register_forward_pre_hook(rec.enter, with_kwargs=True))
                rec.handles.append(m.register_forward_hook(rec.leave, with_kwargs=True))
            with rec.memory, rec.costs, saved, mask_answers(rec.rec.mask_answers):
                train_step(
                    model, args, kwargs, loss_fn, after_forward=rec.after_forward, autocast=autocast
                )
            recording = rec.finish()
    finally:
        rec.costs.kept.unwatch()  # (also when the step raised)
        for h in rec.handles:
            h.remove()
    return recording
