"""Shared builders for the token-batch suites (``token_mlp``, ``bert``).

A workload is a :class:`Model`: one function for one sample (ordinary torch code on
``[N, D]``), one written with raggedfn's ops on a ``(B, N*, D)`` :class:`~raggedfn.Ragged`
and one for batched tensor types (padded ``[B, N_max, D]`` with a key mask,
``torch.nested`` jagged tensors, danling's ``NestedTensor``). Each *system* turns a
harness :class:`~benchmarks.harness.Case` into a :class:`~benchmarks.harness.Step`
the same way:

- the inputs (values ``[T, D]``, parameters, a cotangent) come from the case's seed,
  identical for every system; conversions (padding, nesting) happen outside ``run``;
- ``fwd`` runs the model under ``no_grad``; ``fwd+bwd`` also differentiates the
  output w.r.t. the input and every parameter with the fixed cotangent
  (``torch.autograd.grad``: nothing accumulates between runs);
- ``collect`` returns the per-sample outputs, then (``fwd+bwd``) the per-sample
  input gradients and the parameter gradients, so the harness's agreement check
  covers the backward pass too;
- modes ending in ``compiled`` wrap the model in ``torch.compile`` (same mode for
  the padded baseline); the first two calls of the build measure the compile time
  (first call minus second) and the number of graphs compiled, kept in
  ``Step.extra``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import raggedfn
from benchmarks.harness import DISTRIBUTIONS, Case, Missing, Step, Suite
from raggedfn import Ragged

Params = dict[str, Tensor]

# every build compiles the same module-level functions with other shapes or closures
torch._dynamo.config.recompile_limit = 512
torch._dynamo.config.accumulated_recompile_limit = 4096


@dataclass(frozen=True)
class Model:
    """One workload written once per system; see the module docstring."""

    dim: int
    make_params: Callable[[torch.Generator, torch.dtype], Params]
    sample: Callable[[Tensor, Params], Tensor]  # [N, D] -> [N, D]
    ragged: Callable[[Ragged, Params], Ragged]  # (B, N*, D) -> (B, N*, D)
    batched: Callable[..., Any]  # (x [B, N, D]-like, params, key mask or None)
    # regional compilation (optional): ``stack(layer)`` is the model as a loop over
    # one layer function ``layer(x, layer_params, ...)``; compiled systems then
    # compile the layer once instead of the unrolled stack (compile time ~ 1 layer)
    stack: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
    ragged_layer: Callable[..., Any] | None = None
    batched_layer: Callable[..., Any] | None = None


def is_backward(case: Case) -> bool:
    return case.mode.startswith("fwd+bwd")


def is_compiled(case: Case) -> bool:
    return case.mode.endswith("compiled")


class Inputs:
    """The data of one case, identical for every system (fixed seed)."""

    def __init__(self, case: Case, model: Model) -> None:
        gen = torch.Generator().manual_seed(case.seed)
        self.lengths = list(case.lengths)
        total = sum(self.lengths)
        self.values = torch.randn(total, model.dim, generator=gen, dtype=case.dtype)
        self.params = model.make_params(gen, case.dtype)
        self.cotangent = torch.randn(total, model.dim, generator=gen, dtype=case.dtype)
        self.x = raggedfn.from_lengths(self.values, torch.tensor(self.lengths))
        self.backward = is_backward(case)
        if case.device != "cpu":
            self.values = self.values.to(case.device)
            self.cotangent = self.cotangent.to(case.device)
            self.params = {k: v.to(case.device) for k, v in self.params.items()}
            self.x = raggedfn.from_lengths(self.values, self.x.lengths.to(case.device))

    def split(self, packed: Tensor) -> list[Tensor]:
        return list(packed.detach().split(self.lengths))

    def leaves(self) -> list[Tensor]:
        return [p.detach().clone().requires_grad_(True) for p in self.params.values()]


def make_step(
    inputs: Inputs,
    leaf: Any,
    forward: Callable[[Any, Params], Any],
    cotangent: Any,
    split: Callable[[Any], list[Tensor]],
) -> Step:
    """A step running ``forward(leaf, params)`` (and, in ``fwd+bwd``, its backward).

    ``leaf`` is the system's input (a tensor, a Ragged, a list of tensors, ...) and
    ``split`` turns an output-shaped object into per-sample ``[N_i, D]`` tensors.
    """
    names = list(inputs.params)
    if not inputs.backward:
        params = inputs.params

        def run_fwd() -> Any:
            with torch.no_grad():
                return forward(leaf, params)

        return Step(run_fwd, split)
    leaves = inputs.leaves()
    params = dict(zip(names, leaves, strict=True))
    input_leaves = _tensor_leaves(leaf)
    outputs_of: Callable[[Any], list[Tensor]] = _tensor_leaves

    def run() -> Any:
        out = forward(leaf, params)
        grads = torch.autograd.grad(outputs_of(out), [*input_leaves, *leaves], cotangent)
        return out, grads

    def collect(result: Any) -> list[Tensor]:
        out, grads = result
        n_in = len(input_leaves)
        grad_in = grads[0] if n_in == 1 else list(grads[:n_in])
        return [*split(out), *split(_like(leaf, grad_in)), *(g.detach() for g in grads[n_in:])]

    return Step(run, collect)


def _tensor_leaves(obj: Any) -> list[Tensor]:
    """The tensors autograd sees for a system's input/output object."""
    if isinstance(obj, Ragged):
        return [obj.values]
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


def _like(leaf: Any, grad: Any) -> Any:
    """The gradient of ``leaf`` in ``leaf``'s form (for ``split``)."""
    if isinstance(leaf, Ragged):
        return leaf.with_values(grad)
    return grad


# ----- compile bookkeeping ---------------------------------------------------------------


def compiled_step(step: Step) -> Step:
    """Run the step twice: compile time (first call minus second) and graphs compiled."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    step.run()
    first = time.perf_counter() - start
    start = time.perf_counter()
    step.run()
    second = time.perf_counter() - start
    step.extra["compile_s"] = round(max(0.0, first - second), 2)
    step.extra["graphs"] = counters["stats"]["unique_graphs"] - before
    return step


_COMPILED: dict[Any, Callable[..., Any]] = {}
# extra torch.compile options for every compiled system (tests use a cheaper backend)
COMPILE_OPTIONS: dict[str, Any] = {}


def compile_once(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """One ``torch.compile`` wrapper per (function, options), shared by every build."""
    options = {**COMPILE_OPTIONS, **options}
    key = (fn, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]


def compiled_model(model: Model, kind: str) -> Callable[..., Any]:
    """``model.ragged`` or ``model.batched`` (``kind``) compiled, by layer where it can be."""
    whole = model.ragged if kind == "ragged" else model.batched
    layer = model.ragged_layer if kind == "ragged" else model.batched_layer
    if model.stack is None or layer is None:
        return compile_once(whole)
    return model.stack(compile_once(layer))


# ----- systems ---------------------------------------------------------------------------


def _ragged_forward(model: Model) -> Callable[[Ragged, Params], Tensor]:
    def forward(x: Ragged, params: Params) -> Ragged:
        return model.ragged(x, params)

    return forward


def build_raggedfn(case: Case, model: Model) -> Step:
    """raggedfn's ops on the packed batch (compiled: ``mark_dynamic`` + torch.compile)."""
    inputs = Inputs(case, model)
    x = inputs.x
    if inputs.backward:
        x = x.with_values(inputs.values.clone().requires_grad_(True))
    forward: Callable[..., Any] = model.ragged
    if is_compiled(case):
        raggedfn.mark_dynamic(x)
        forward = compiled_model(model, "ragged")
    split = lambda out: inputs.split(out.values)  # noqa: E731
    step = make_step(inputs, x, forward, inputs.cotangent, split)
    return compiled_step(step) if is_compiled(case) else step


def build_map(case: Case, model: Model) -> Step:
    """``raggedfn.map`` of the per-sample model (ordinary torch code for one sample)."""
    inputs = Inputs(case, model)
    x = inputs.x
    if inputs.backward:
        x = x.with_values(inputs.values.clone().requires_grad_(True))
    sample = model.sample

    def forward(y: Ragged, params: Params) -> Ragged:
        return raggedfn.map(sample, y, params, in_dims=(0, None))

    if is_compiled(case):
        # its first compiled call builds ~20 graphs (15-25 s per BERT scale on 2 cores)
        raise Missing("map runs eagerly only here (compile-time budget)")
    split = lambda out: inputs.split(out.values)  # noqa: E731
    return make_step(inputs, x, forward, inputs.cotangent, split)


def build_padded(case: Case, model: Model) -> Step:
    """The model on zero-padded ``[B, N_max, D]`` with a key mask (inputs padded outside)."""
    inputs = Inputs(case, model)
    padded = raggedfn.to_padded(inputs.x)
    key_mask = raggedfn.mask(inputs.x)[:, None, None, :]  # [B, 1, 1, N]: True = attend
    if inputs.backward:
        padded.requires_grad_(True)
    cotangent = raggedfn.to_padded(inputs.x.with_values(inputs.cotangent))
    batched = compiled_model(model, "batched") if is_compiled(case) else model.batched

    def forward(p: Tensor, params: Params) -> Tensor:
        return batched(p, params, key_mask)

    def split(out: Tensor) -> list[Tensor]:
        return [out[i, :n].detach() for i, n in enumerate(inputs.lengths)]

    step = make_step(inputs, padded, forward, cotangent, split)
    return compiled_step(step) if is_compiled(case) else step


def build_loop(case: Case, model: Model) -> Step:
    """A Python loop of the per-sample model over contiguous ``[N_i, D]`` tensors."""
    if is_compiled(case):
        raise Missing("the loop runs eagerly only")
    inputs = Inputs(case, model)
    samples = [t.clone() for t in inputs.values.split(inputs.lengths)]
    if inputs.backward:
        samples = [t.requires_grad_(True) for t in samples]
    cotangent = list(inputs.cotangent.split(inputs.lengths))
    sample = model.sample

    def forward(ts: Sequence[Tensor], params: Params) -> list[Tensor]:
        return [sample(t, params) for t in ts]

    return make_step(inputs, samples, forward, cotangent, lambda out: [t.detach() for t in out])


def build_nested(case: Case, model: Model) -> Step:
    """``torch.nested`` jagged tensors (min/max lengths given)."""
    if is_compiled(case):
        raise Missing("torch.nested runs eagerly only here")
    inputs = Inputs(case, model)
    values = inputs.values.clone()
    if inputs.backward:
        values.requires_grad_(True)
    offsets = inputs.x.offsets
    lo, hi = min(inputs.lengths), max(inputs.lengths)

    def nest(v: Tensor) -> Tensor:
        return torch.nested.nested_tensor_from_jagged(v, offsets, min_seqlen=lo, max_seqlen=hi)

    def forward(v: Tensor, params: Params) -> Tensor:
        return model.batched(nest(v), params, None).values()

    return make_step(inputs, values, forward, inputs.cotangent, inputs.split)


def build_danling(case: Case, model: Model) -> Step:
    """danling's ``NestedTensor`` (optional dependency: ``missing`` without it)."""
    if is_compiled(case):
        raise Missing("danling runs eagerly only here")
    try:
        from danling import NestedTensor
    except ImportError as error:
        raise Missing("danling is not installed (pip install danling)") from error
    inputs = Inputs(case, model)
    values = inputs.values.clone()
    if inputs.backward:
        values.requires_grad_(True)
    lengths = inputs.lengths

    def forward(v: Tensor, params: Params) -> Tensor:
        nt = NestedTensor(list(v.split(lengths)))
        out = model.batched(nt, params, None)
        return torch.cat(list(out.unbind()))

    return make_step(inputs, values, forward, inputs.cotangent, inputs.split)


SYSTEMS: dict[str, Callable[[Case, Model], Step]] = {
    "padded": build_padded,
    "raggedfn": build_raggedfn,
    "map": build_map,
    "nested": build_nested,
    "danling": build_danling,
    "loop": build_loop,
}


def systems_for(model_of: Callable[[Case], Model]) -> dict[str, Callable[[Case], Step]]:
    """The harness's ``Suite.systems``: one builder per system for ``model_of(case)``."""

    def bind(build: Callable[[Case, Model], Step]) -> Callable[[Case], Step]:
        return lambda case: build(case, model_of(case))

    return {name: bind(build) for name, build in SYSTEMS.items()}


# ----- suites with per-workload sizes ----------------------------------------------------


def lengths_by_workload(
    sizes: dict[str, tuple[int, float]], distributions: Sequence[str]
) -> dict[str, dict[str, list[int]]]:
    """``{distribution: {workload: lengths}}`` as :class:`SizedSuite` draws them (for the record)."""
    return {
        d: {w: DISTRIBUTIONS[d].lengths(batch, scale) for w, (batch, scale) in sizes.items()}
        for d in distributions
    }


@dataclass
class SizedSuite(Suite):
    """A :class:`~benchmarks.harness.Suite` whose workloads have their own batch size.

    ``sizes(quick)`` maps a workload to ``(batch, length scale)``: lengths are the
    distribution's first ``batch`` draws times ``scale`` (so the heavy BERT-base
    cell fits the time budget); ``runs(case)`` drops (distribution, mode) pairs a
    suite does not measure (e.g. compiled modes only on two distributions).
    """

    sizes: Callable[[bool], dict[str, tuple[int, float]]] = lambda quick: {}
    runs: Callable[[Case], bool] = lambda case: True

    def cases(
        self,
        quick: bool = False,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> list[Case]:
        params = self.params(quick)
        out = []
        for dist in self.distributions(quick):
            for workload in self.workloads:
                if workload not in self.sizes(quick):
                    continue  # not measured in this kind of run (e.g. BERT-base in --quick)
                batch, size_scale = self.sizes(quick)[workload]
                lengths = tuple(
                    DISTRIBUTIONS[dist].lengths(batch, size_scale if scale is None else scale)
                )
                for mode in self.modes:
                    case = Case(self.name, workload, mode, dist, lengths, params, device, dtype)
                    if self.runs(case):
                        out.append(case)
        return out
