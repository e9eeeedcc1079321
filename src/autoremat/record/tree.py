"""Claim 1: extract the modules that run and build the multi-way module tree.

What a :class:`Node` holds, and which modules the tree keeps (a container that never ran is
dissolved, its children that ran in its place): docs/method.md, "Claim 1: four steps".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat.core.classes import own_class
from autoremat.core.huggingface import cache_off_in_training
from autoremat.core.layerdrop import every_layer
from autoremat.core.nested import iter_tensors, op_tensors, run_model
from autoremat.record.meta_kernels import RememberedKernels
from autoremat.record.side_effects import ReplayCheck
from autoremat.record.snapshot import preserved

__all__ = [
    "ExampleInputsError",
    "Node",
    "TensorInfo",
    "build_tree",
    "find_blocks",
    "tensor_infos",
]


@dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and size of one tensor that flowed into or out of a module.

    ``where`` says where the tensor sat in the nested structure, e.g. ``args[0]``,
    ``kwargs['attention_mask']`` or ``out.logits``.
    """

    where: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(eq=False)
class Node:
    """One module of the tree (claim 1).

    ``inputs`` and ``outputs`` describe the module's first call; ``calls`` counts how many times
    its ``forward`` ran during one forward pass of the model (more than one for shared modules).

    ``replay_reason`` says why recomputing the module would not replay its forward (a Python
    attribute of it or of a module inside it changes during the forward); a module around it
    has one too. ``inplace_reason`` says why checkpointing the module would fail backward (an
    input of it is changed in place after its call began); that concerns its boundary only.
    Both are ``None`` when nothing was seen (:mod:`autoremat.record.side_effects`).

    In a profile's tree of calls (:attr:`~autoremat.costs.profile.Profile.tree`) a node is one call
    of a module instead: ``call`` is its index among the module's ``calls`` (``None`` when the
    module ran once),
    ``path`` the call's name (``path@k``, :func:`autoremat.core.entries.call_key`),
    ``inputs``/``outputs`` that call's, and its children the calls made while it ran.
    """

    name: str
    path: str
    module: nn.Module = field(repr=False)
    children: list[Node] = field(default_factory=list, repr=False)
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    calls: int = 0
    replay_reason: str | None = None
    inplace_reason: str | None = None
    call: int | None = None

    @property
    def module_path(self) -> str:
        """The path of the node's module (``path`` less a call's ``@k``)."""
        return self.path if self.call is None else self.path.rpartition("@")[0]

    @property
    def recompute_reason(self) -> str | None:
        """Why this module cannot be recomputed on its own (``replay_reason``, else
        ``inplace_reason``), or ``None``."""
        return self.replay_reason or self.inplace_reason

    @property
    def is_leaf(self) -> bool:
        """A node without child nodes."""
        return not self.children

    @property
    def type_name(self) -> str:
        """The module's own class name (the class it had before autoremat wrapped it)."""
        return own_class(self.module).__name__

    @property
    def input_bytes(self) -> int:
        return sum(t.bytes for t in self.inputs)

    @property
    def output_bytes(self) -> int:
        return sum(t.bytes for t in self.outputs)

    def walk(self) -> Iterator[Node]:
        """This node and all its descendants, depth first, in registration order."""
        yield self
        for child in self.children:
            yield from child.walk()

    def find(self, path: str) -> Node:
        """The node at ``path``; raises ``KeyError`` naming the path if there is none."""
        for node in self.walk():
            if node.path == path:
                return node
        raise KeyError(f"no module {path!r} in the tree")

    def render(self, marked: frozenset[str] = frozenset()) -> str:
        """An indented listing: one line per node with its type, calls and I/O shapes.

        Paths in ``marked`` are shown with a ``*`` (used by :class:`~autoremat.Plan`).
        """
        lines: list[str] = []

        def io(infos: tuple[TensorInfo, ...]) -> str:
            shown = ", ".join(str(t) for t in infos[:2])
            more = f", +{len(infos) - 2}" if len(infos) > 2 else ""
            return f"({shown}{more})"

        def visit(node: Node, depth: int) -> None:
            mark = "*" if node.path in marked else " "
            label = node.path or "(root)"
            calls = f" x{node.calls}" if node.calls > 1 else ""
            lines.append(
                f"{mark} {'  ' * depth}{label}: {node.type_name}{calls} "
                f"{io(node.inputs)} -> {io(node.outputs)}"
            )
            for child in node.children:
                visit(child, depth + 1)

        visit(self, 0)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def tensor_infos(obj: Any, where: str) -> list[TensorInfo]:
    """Every tensor found in ``obj``: nested tuples, lists, dicts, dataclasses and
    ``ModelOutput`` objects are searched; other objects are skipped."""
    return [
        TensorInfo(path, tuple(t.shape), t.dtype, t.numel() * t.element_size())
        for path, t in iter_tensors(obj, where)
    ]


class ExampleInputsError(ValueError, RuntimeError):
    """The example inputs failed in the model's forward; the message names the module where
    (``where``: its path, ``""`` for the root; the error itself is ``__cause__``). A
    ``ValueError`` (a bad argument), and a ``RuntimeError`` like the error it wraps."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


def build_tree(
    model: nn.Module, args: tuple[Any, ...] | Any = (), kwargs: dict[str, Any] | None = None
) -> Node:
    """Run ``model(*args, **kwargs)`` once and return the tree of the modules that ran (claim 1).

    The forward pass runs without gradients and the model is left exactly as it was found
    (:func:`autoremat.record.snapshot.preserved`). ``args`` may be a single tensor. The same run
    finds what a recompute of each module could not replay (``Node.replay_reason`` and
    ``inplace_reason``), with a second, detailed forward when that one changed Python state
    (:mod:`autoremat.record.side_effects` says how, and what it costs).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ExampleInputsError: (a ``ValueError``) the forward pass failed; the message names the
            innermost module that was running when it failed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    paths = {id(m): p for p, m in model.named_modules()}
    calls = _Calls(paths, ReplayCheck(paths, detailed=False))
    with contextlib.ExitStack() as hooks:  # (a hook's handle removes it on exit)
        for m in dict.fromkeys(model.modules()):
            hooks.enter_context(m.register_forward_pre_hook(calls.pre_hook, with_kwargs=True))
            hooks.enter_context(m.register_forward_hook(calls.post_hook, with_kwargs=True))
        # (without a Hugging Face cache, as the step it stands for: the wrapped model trains
        # with use_cache=False)
        with preserved(model), torch.no_grad(), cache_off_in_training(model, without_grad=True):
            _run(calls, model, args, kwargs)
            if calls.check.replay:
                # Python state changed: perhaps only a first forward's lazy set-up (a
                # classification head's config.problem_type). What a recompute would see in
                # training is what a second forward changes; look at it in detail.
                calls.recording = False
                calls.check = ReplayCheck(paths, detailed=True, previous=calls.check)
                _run(calls, model, args, kwargs)
    (root,) = calls.nodes("", model)
    return root


def _run(calls: _Calls, model: nn.Module, args: Any, kwargs: Any) -> None:
    """One forward under the hooks of ``calls``, then its replay check's end; a failure is
    an :class:`ExampleInputsError` naming the module where it arose."""
    tensors = (*model.parameters(), *op_tensors((args, kwargs)))
    on_meta = any(t.device.type == "meta" for t in tensors)
    with every_layer(model):  # (until the check has ended: the switch back is no change)
        try:
            with RememberedKernels() if on_meta else contextlib.nullcontext():
                run_model(model, args, kwargs)
        except Exception as exc:
            where = calls.running[-1] if calls.running else ""
            raise ExampleInputsError(
                f"the example inputs failed in the forward pass of module "
                f"{where or '(root)'!r} ({type(exc).__name__}: {exc}); pass args/kwargs "
                f"that model(*args, **kwargs) accepts",
                where,
            ) from exc
        calls.check.finish()  # before the model's state is put back


class _Calls:
    """The forward hooks of :func:`build_tree`: which modules ran, how often, with what I/O,
    and what a recompute of each could not replay (``check``)."""

    def __init__(self, paths: dict[int, str], check: ReplayCheck) -> None:
        self.paths = paths
        self.check = check
        self.recording = True  # False: a second forward, for the check only
        self.calls: dict[int, int] = {}
        self.first_io: dict[int, tuple[tuple[TensorInfo, ...], tuple[TensorInfo, ...]]] = {}
        # a first call's inputs, by module, with its depth (a module may call itself)
        self.pending: dict[int, tuple[int, tuple[TensorInfo, ...]]] = {}
        self.running: list[str] = []

    def pre_hook(self, module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        key = id(module)
        self.running.append(self.paths.get(key, "?"))
        self.check.enter(module, a, kw)
        if not self.recording:
            return
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] == 1:
            infos = tuple(tensor_infos(a, "args") + tensor_infos(kw, "kwargs"))
            self.pending[key] = (len(self.running), infos)

    def post_hook(self, module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], out: Any):
        key, depth = id(module), len(self.running)
        self.running.pop()
        self.check.leave(module, out)
        if self.pending.get(key, (0,))[0] == depth:  # (the first call ends, not one inside it)
            self.first_io[key] = (self.pending.pop(key)[1], tuple(tensor_infos(out, "out")))

    def nodes(self, path: str, module: nn.Module) -> list[Node]:
        """Nodes for ``module``: itself if it ran, else its children that ran (dissolved)."""
        children: list[Node] = []
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if self.paths.get(id(child)) != child_path:
                continue  # a shared module: it lives at its first path only
            children.extend(self.nodes(child_path, child))
        key = id(module)
        if key not in self.calls and path:
            return children
        inputs, outputs = self.first_io.get(key, ((), ()))
        return [
            Node(
                name=path.rsplit(".", 1)[-1],
                path=path,
                module=module,
                children=children,
                inputs=inputs,
                outputs=outputs,
                calls=self.calls.get(key, 0),
                replay_reason=self.check.replay.get(key),
                inplace_reason=self.check.inplace.get(key),
            )
        ]


def find_blocks(tree: Node, by: str = "class") -> list[str]:
    """The paths of the model's "blocks": the largest group of sibling nodes of ``tree`` that
    are not leaves and have the same class (``by="class"``), or that sit numbered in one
    container, whatever their classes (``by="container"``: ``layers.0``, ``layers.1``, ... of
    a ``ModuleList`` or ``Sequential``, such as a hybrid model's mamba and attention layers).

    Siblings are the children of one node (containers such as ``nn.ModuleList`` that never
    ran are dissolved by :func:`autoremat.build_tree`, so ``h.0 .. h.11`` are siblings). Ties
    go to the shallower group, then to the group met first (depth first, registration order).
    A group needs at least two members; returns ``[]`` when there is none (a plain chain of
    leaves, a model without repeated structure). Pure: reads the tree only.

    Raises:
        ValueError: ``by`` is neither ``"class"`` nor ``"container"``.
    """
    if by not in ("class", "container"):
        raise ValueError(f"by must be 'class' or 'container', got {by!r}")
    best: list[Node] = []
    best_depth = 0
    stack: list[tuple[Node, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        groups: dict[str, list[Node]] = {}
        for child in node.children:
            container, _, index = child.path.rpartition(".")
            key = child.type_name if by == "class" else container if index.isdigit() else None
            if not child.is_leaf and key is not None:
                groups.setdefault(key, []).append(child)
        for group in groups.values():
            size = len(group)
            if size >= 2 and (size > len(best) or (size == len(best) and depth + 1 < best_depth)):
                best, best_depth = group, depth + 1
        stack.extend((child, depth + 1) for child in reversed(node.children))
    return [n.path for n in best]
