"""Claim 1: extract the modules that run and build the multi-way module tree.

A :class:`Node` holds what the method needs of one module: its name, its path from the root
(the qualified name of ``model.named_modules()``), its children in registration order, the
module object itself, and what flowed in and out of it on the example inputs.

The tree holds the *computation* modules: those whose ``forward`` ran. A module that never ran
itself (an ``nn.ModuleList`` or ``nn.ModuleDict`` container, or a module its parent bypassed) is
dissolved: its children that did run take its place among its parent's children. Modules that
did not run and have no descendant that ran are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autoremat.snapshot import preserved


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
    """

    name: str
    path: str
    module: nn.Module = field(repr=False)
    children: list[Node] = field(default_factory=list, repr=False)
    inputs: tuple[TensorInfo, ...] = ()
    outputs: tuple[TensorInfo, ...] = ()
    calls: int = 0

    @property
    def is_leaf(self) -> bool:
        """A node without child nodes."""
        return not self.children

    @property
    def type_name(self) -> str:
        """The module's own class name (the class it had before autoremat wrapped it)."""
        cls = type(self.module)
        return getattr(cls, "_autoremat_base", cls).__name__

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

    def render(self, marked: frozenset[str] = frozenset(), max_io: int = 2) -> str:
        """An indented listing: one line per node with its type, calls and I/O shapes.

        Paths in ``marked`` are shown with a ``*`` (used by :class:`~autoremat.plan.Plan`).
        """
        lines: list[str] = []

        def io(infos: tuple[TensorInfo, ...]) -> str:
            shown = ", ".join(str(t) for t in infos[:max_io])
            more = f", +{len(infos) - max_io}" if len(infos) > max_io else ""
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
    found: list[TensorInfo] = []
    for path, tensor in iter_tensors(obj, where):
        found.append(
            TensorInfo(
                where=path,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                bytes=tensor.numel() * tensor.element_size(),
            )
        )
    return found


def iter_tensors(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(where, tensor)`` for every tensor nested in ``obj`` (see :func:`tensor_infos`)."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{where}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{where}.{f.name}")


def run_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """Call ``model(*args, **kwargs)``; a bare ``args`` that is not a tuple is one argument."""
    if not isinstance(args, tuple):
        args = (args,)
    return model(*args, **(kwargs or {}))


class ExampleInputsError(ValueError, RuntimeError):
    """The example inputs failed in the model's forward; the message names the module where.
    A ``ValueError`` (a bad argument), and a ``RuntimeError`` like the error it wraps."""


def build_tree(
    model: nn.Module,
    args: tuple[Any, ...] | Any = (),
    kwargs: dict[str, Any] | None = None,
) -> Node:
    """Run ``model(*args, **kwargs)`` once and return the tree of the modules that ran.

    This is claim 1 of the method: extraction of the computation modules and creation of the
    multi-way tree. The forward pass runs without gradients and the model is left exactly as it
    was found (buffers such as BatchNorm statistics, training mode, gradients, the global RNG
    state; see :func:`autoremat.snapshot.preserved`). ``args`` may be a single tensor.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ExampleInputsError: (a ``ValueError``) the forward pass failed; the message names the
            innermost module that was running when it failed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    paths = {id(m): p for p, m in model.named_modules()}
    calls: dict[int, int] = {}
    first_io: dict[int, tuple[tuple[TensorInfo, ...], tuple[TensorInfo, ...]]] = {}
    pending_inputs: dict[int, tuple[TensorInfo, ...]] = {}
    running: list[str] = []

    def pre_hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        key = id(module)
        running.append(paths.get(key, "?"))
        calls[key] = calls.get(key, 0) + 1
        if calls[key] == 1:
            pending_inputs[key] = tuple(tensor_infos(a, "args") + tensor_infos(kw, "kwargs"))

    def post_hook(module: nn.Module, a: tuple[Any, ...], kw: dict[str, Any], out: Any) -> None:
        key = id(module)
        running.pop()
        if key in pending_inputs:
            first_io[key] = (pending_inputs.pop(key), tuple(tensor_infos(out, "out")))

    handles = []
    try:
        for m in dict.fromkeys(model.modules()):
            handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
        with preserved(model), torch.no_grad():
            try:
                run_model(model, args, kwargs)
            except Exception as exc:
                where = running[-1] if running else ""
                raise ExampleInputsError(
                    f"the example inputs failed in the forward pass of module "
                    f"{where or '(root)'!r} ({type(exc).__name__}: {exc}); pass args/kwargs "
                    f"that model(*args, **kwargs) accepts"
                ) from exc
    finally:
        for h in handles:
            h.remove()

    def make(path: str, module: nn.Module) -> list[Node]:
        """Nodes for ``module``: itself if it ran, else its children that ran (dissolved)."""
        children: list[Node] = []
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if paths.get(id(child)) != child_path:
                continue  # a shared module: it lives at its first path only
            children.extend(make(child_path, child))
        key = id(module)
        if key not in calls and path:
            return children
        inputs, outputs = first_io.get(key, ((), ()))
        return [
            Node(
                name=path.rsplit(".", 1)[-1],
                path=path,
                module=module,
                children=children,
                inputs=inputs,
                outputs=outputs,
                calls=calls.get(key, 0),
            )
        ]

    (root,) = make("", model)
    return root
