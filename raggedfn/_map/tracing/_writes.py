"""In-place writes while tracing a per-sample function: refused where a real tensor or an
argument would be written (the call runs per sample, which writes as the loop does), and
turned into their out-of-place twins where the write is provably local."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..base._registry import op_name
from ..base._sizes import Unsupported

if TYPE_CHECKING:
    from ..base._steps import Step

_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_"})


_OPERATOR_WRITES = frozenset(
    {
        "__setitem__",
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__imatmul__",
    }
)


class NoRealWrites(TorchFunctionMode):
    """Refuse, while tracing, an in-place write into a real tensor (one ``f`` captures).

    make_fx runs an op whose inputs are all real constants for real (to propagate
    constant values), so ``state.add_(1)`` on a captured tensor would change the
    caller's tensor during the trace. Refused here before it runs, the trace fails
    and the call runs per sample, which writes once per sample as the loop does.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target: Any = None
        if args and (
            name in _OPERATOR_WRITES
            or (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES)
        ):
            target = args[0]
        elif isinstance(kwargs.get("out"), Tensor):
            target = kwargs["out"]
        if isinstance(target, Tensor) and not isinstance(target, FakeTensor):
            raise Unsupported(f"in-place {name} writes into a tensor f captures")
        if name == "take_along_dim":
            return _take_along_dim(*args, **kwargs)
        return func(*args, **kwargs)


def _take_along_dim(x: Tensor, indices: Tensor, dim: Any = None) -> Tensor:
    """``take_along_dim`` as the ``gather`` it is: its meta function fixes symbolic sizes
    to the example's (a guard per size), gather's keeps them symbolic."""
    if dim is None or x.ndim != indices.ndim:
        return torch.take_along_dim(x, indices, dim)
    dim = dim % x.ndim
    shape = [
        s if p == dim else torch.sym_max(s, t)
        for p, (s, t) in enumerate(zip(x.shape, indices.shape, strict=True))
    ]
    x = x.expand([x.shape[dim] if p == dim else s for p, s in enumerate(shape)])
    indices = indices.expand([indices.shape[dim] if p == dim else s for p, s in enumerate(shape)])
    return torch.gather(x, dim, indices)


def _mutates(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


# ops whose schema promises a fresh result but whose eager kernel returns the input
# itself in some cases: dropout of every kind when not training, with p = 0 or on an
# empty input; type_as to the same type. An in-place op on their result writes the input.
_MAY_RETURN_INPUT = frozenset(
    {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "type_as"}
)


def _aliases(node: Any) -> bool:
    """Whether ``node``'s result may share memory with an input (a view, or unknown)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return True
    if schema.name.split("::")[-1] in _MAY_RETURN_INPUT:
        return True
    return any(r.alias_info is not None for r in schema.returns)


def functional_twin(node: Any) -> Any:
    """The out-of-place op for an in-place ``node`` whose effect is local, or None.

    Only for ``op_(h, ...)`` writing its first argument ``h`` where ``h`` is a fresh
    tensor (made by a non-view op, possibly through other such in-place ops) that no
    view op ever reads: then writing ``h`` and replacing ``h`` (and its in-place
    aliases) by the result are the same for every later reader.
    """
    schema = getattr(node.target, "_schema", None)
    if schema is None or not _mutates(node.target) or not node.args:
        return None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or written[0].name != schema.arguments[0].name:
        return None
    if alias_chain(node.args[0]) is None:
        return None
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or not schema.name.startswith("aten::"):  # twins: aten's
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, node.target._overloadname, None) if packet is not None else None
    if overload is None or _mutates(overload):
        return None
    return overload


def alias_chain(base: Any) -> list[Any] | None:
    """``base`` and the nodes it aliases through handled in-place ops, back to a fresh
    tensor; None when some alias may be a view or is read by a view op."""
    chain = []
    while True:
        if not isinstance(base, torch.fx.Node):
            return None
        if any(not _aliases_free(user) for user in base.users):
            return None
        chain.append(base)
        if not _aliases(base):
            return chain
        if base.op != "call_function" or not _mutates(base.target):
            return None
        # _mutates(base.target) above: the target is an op with a schema
        schema = cast(Any, base.target)._schema
        written = [
            a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
        ]
        if len(written) != 1 or written[0].name != schema.arguments[0].name:
            return None
        base = base.args[0]


def _aliases_free(node: Any) -> bool:
    """A reader of a tensor that keeps no view of it."""
    if node.op == "output" or node.target is operator.getitem or not _aliases(node):
        return True
    return _mutates(node.target)  # another in-place op: rebound too, or refused


def check_writes(gm: Any, steps: list[Step]) -> None:
    """Refuse in-place writes whose effect the batched plan cannot reproduce.

    Writes into an argument or a captured tensor must happen once per sample (the
    loop's side effect on shared data) and never reach the caller's mapped inputs;
    writes into per-sample values are batched only where :func:`functional_twin`
    proves them local. Either refusal makes the call run the per-sample loop.
    """
    by_name = {step.name: step for step in steps}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _mutates(node.target):
            continue
        root = _alias_root(node.args[0]) if node.args else None
        name = op_name(node.target)
        if root is not None and root.op == "placeholder":
            raise Unsupported(f"in-place op {name} writes into an argument of f")
        if root is not None and root.op == "get_attr":
            raise Unsupported(f"in-place op {name} writes into a tensor f captures")
        step = by_name.get(node.name)
        if step is not None and step.batched and step.rebind is None:
            # batched values are often copies where a sample would be a view (a gathered
            # row, a canonicalised layout): an in-place op could diverge from the loop
            raise Unsupported(f"in-place op {name} on a per-sample value")


def _alias_root(node: Any) -> Any:
    """The node whose memory ``node`` shares: follow views and in-place results back."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 10000:
        seen += 1
        if node.op in ("placeholder", "get_attr"):
            return node
        if node.op != "call_function":
            return node
        if node.target is operator.getitem:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and _aliases(source) and source.args:
                node = source.args[0]
                continue
            return node
        if node.target is torch.ops.aten.lift_fresh_copy.default:
            return node
        if _aliases(node) and node.args:
            node = node.args[0]
            continue
        return node
    return None
