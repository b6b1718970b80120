"""Judging ``raggedfn.map`` on generated programs against the per-sample loop.

``check(program, batch)`` runs the program's function through ``map`` and as the
per-sample Python loop (float64) and classifies the outcome:

- ``agree``: values, gradients (w.r.t. the packed input values and the shared
  parameters), shapes, output types, the caller's inputs and shared state all match;
- disagreements (``FAILURES``): ``values``, ``grad``, ``shape``, ``type`` (output
  structure, dtype, per-sample numbers not restacked to ``[B]``, or an output that
  is ``Ragged`` for one batch and dense for another), ``caller-mutated`` (map
  changed the caller's packed values: ``_version`` or contents),
  ``shared-state`` (an in-place write to an ``in_dims=None`` argument differs
  from the loop's), ``random`` (samples got the same noise), ``loop-raised``
  (the loop raised but map returned), ``crash`` (map raised something other
  than ``RaggedError`` where the loop ran);
- allowed by the contract but counted: ``refused`` (map raised ``RaggedError``
  where the loop ran), ``both-raised``, ``empty-reduction`` (the loop raised on a
  reduction of an empty sample and map returned DESIGN §4's identity), and
  ``rounding-tie``: map's values, gradients or shapes differ from the loop's, but equal
  those of the loop run on inputs moved by one ulp in a few random places (a decision,
  ``h > 0`` or ``relu``, taken on a value that is zero up to rounding: the mean of a
  centred column comes out +-1e-17 depending on the order of the additions, and the
  mask that follows keeps or drops a row). Equality up to rounding is all a batched
  run can promise there; a real bug (a dropped row, a wrong value) matches no nearby
  input (``test_map_programs`` plants both kinds).

Programs with random steps are compared by structure (shapes, types) and by a
noise check: on a batch of copies of one sample, ``map``'s samples must not all
be equal when eight loop runs on that sample all differ.

``python -m property_tests.map_oracle --programs 20000`` is the deep run
(``make test-deep``): counts per outcome, times, the first program of each class
and a shrunk reproducer per class (``map_search`` runs many programs and shrinks).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import raggedfn
from property_tests.map_programs import Batch, Program, params
from property_tests.reference import samples

FAILURES = (
    "values",
    "grad",
    "shape",
    "type",
    "caller-mutated",
    "shared-state",
    "random",
    "loop-raised",
    "crash",
)
ALLOWED = ("agree", "refused", "both-raised", "empty-reduction", "rounding-tie")
# disagreements rechecked against the loop on inputs one ulp away (see the docstring)
_TIE_KINDS = ("values", "grad", "shape")
TIE_TRIES = 8
GRAD_PARAMS = ("w", "b", "g", "w2", "row")
MapFn = Callable[..., Any]


@dataclasses.dataclass
class Outcome:
    kind: str
    detail: str = ""
    warnings: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES


class _Found(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail


def _call(fn: Callable[[], Any], caught: list[str]) -> tuple[Any, BaseException | None]:
    """Run ``fn`` with warnings recorded (a fallback's warning is not a failure here)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
    caught.extend(f"{w.category.__name__}: {str(w.message).splitlines()[0][:120]}" for w in record)
    return result, error


def _describe_error(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "raggedfn" in f.filename.replace("\\", "/")]
    where = f" at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" if ours else ""
    message = str(error).splitlines()[0][:160] if str(error) else ""
    return f"{type(error).__name__}{where}: {message}"


_EMPTY_REDUCTION = ("reduction dim", "no elements", "does not have an identity")


def _is_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float)) and not isinstance(v, torch.Tensor)


def _per_sample(got: Any, batch_size: int, what: str) -> list[Any]:
    if isinstance(got, raggedfn.Ragged):
        try:
            parts = samples(got)
        except Exception as error:
            raise _Found("type", f"{what}: a malformed Ragged ({_describe_error(error)})") from None
    elif isinstance(got, torch.Tensor) and got.ndim >= 1 and got.shape[0] == batch_size:
        parts = list(got.unbind(0))
    else:
        raise _Found("type", f"{what}: expected a Ragged or a [B, ...] tensor, got {_brief(got)}")
    if len(parts) != batch_size:
        raise _Found("type", f"{what}: {len(parts)} samples instead of {batch_size}")
    return parts


def _brief(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {tuple(v.shape)}"
    if isinstance(v, raggedfn.Ragged):
        return f"a Ragged {v.shape}"
    return f"{type(v).__name__} {v!r}"[:80]


def _compare_leaf(got: Any, column: list[Any], what: str, values: bool) -> None:
    batch_size = len(column)
    if all(_is_number(c) for c in column):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (batch_size,):
            raise _Found("type", f"{what}: per-sample numbers {column} came back as {_brief(got)}")
        first = column[0]
        want = (
            (lambda d: d == torch.bool)
            if isinstance(first, bool)
            else (lambda d: d == torch.int64)
            if isinstance(first, int)
            else (lambda d: d.is_floating_point)
        )
        if not want(got.dtype):
            raise _Found("type", f"{what}: per-sample {type(first).__name__}s as {got.dtype}")
        if (
            values
            and got.tolist() != column
            and not torch.allclose(got.double(), torch.tensor(column, dtype=torch.float64))
        ):
            raise _Found("values", f"{what}: map {got.tolist()} vs loop {column}")
        return
    if not all(isinstance(c, torch.Tensor) for c in column):
        raise _Found("type", f"{what}: the loop returned mixed types {[_brief(c) for c in column]}")
    parts = _per_sample(got, batch_size, what)
    for i, (g, e) in enumerate(zip(parts, column, strict=True)):
        if g.shape != e.shape:
            raise _Found(
                "shape", f"{what}, sample {i}: shape {tuple(g.shape)} vs loop {tuple(e.shape)}"
            )
        if g.dtype != e.dtype:
            raise _Found("type", f"{what}, sample {i}: dtype {g.dtype} vs loop {e.dtype}")
    if not values:
        return
    for i, (g, e) in enumerate(zip(parts, column, strict=True)):
        try:
            torch.testing.assert_close(g.detach(), e.detach(), equal_nan=True)
        except AssertionError as error:
            lines = str(error).splitlines()
            raise _Found("values", f"{what}, sample {i}: {' '.join(lines[:4])[:300]}") from None


def assert_restacked(got: Any, expected: list[Any]) -> None:
    """``got`` (what ``map`` returned) equals the per-sample list ``expected`` leaf by
    leaf: the same structure, every sample's shape, dtype and values (NaN equal to
    NaN), per-sample Python numbers as a ``[B]`` tensor of the matching dtype."""
    if not expected:
        return
    flat = [pytree.tree_flatten(e) for e in expected]
    leaves, spec = pytree.tree_flatten(got, is_leaf=lambda v: isinstance(v, raggedfn.Ragged))
    assert spec == flat[0][1], f"type: output structure {spec} vs loop {flat[0][1]}"
    columns = zip(*(leaves for leaves, _ in flat), strict=True)
    for j, (g, column) in enumerate(zip(leaves, columns, strict=True)):
        try:
            _compare_leaf(g, list(column), f"output {j}", values=True)
        except _Found as found:
            raise AssertionError(f"{found.kind}: {found.detail}") from None


def _loss(leaves: list[Any]) -> torch.Tensor | None:
    total = None
    for v in leaves:
        if isinstance(v, raggedfn.Ragged):
            v = v.values
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            w = torch.where(v.isfinite(), v, torch.zeros_like(v))
            term = (w * w).sum() + w.sum()
            total = term if total is None else total + term
    return total


def _grads(loss: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(got, inputs, strict=True)]


def _key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        d = v.detach().contiguous()
        return (tuple(d.shape), str(d.dtype), d.numpy().tobytes())
    return repr(v)


def check(program: Program, batch: Batch, map_fn: MapFn = raggedfn.map) -> Outcome:
    """Run ``program`` on ``batch`` with ``map_fn`` and as the loop; classify."""
    caught: list[str] = []
    try:
        _check(program, batch, map_fn, caught)
    except _Found as found:
        if found.kind in _TIE_KINDS and "random" not in program.tags():
            for trial in range(1, TIE_TRIES + 1):
                try:
                    _check(program, batch, map_fn, [], nudge=trial)
                except _Found:
                    continue
                return Outcome("rounding-tie", found.detail, tuple(caught))
        return Outcome(found.kind, found.detail, tuple(caught))
    return Outcome("agree", "", tuple(caught))


def _nudged(values: torch.Tensor, trial: int) -> torch.Tensor:
    """``values`` with about a quarter of its entries moved by one ulp, up or down
    (the choice drawn from ``trial``); differentiable as the identity."""
    gen = torch.Generator().manual_seed(trial)
    pick = torch.rand(values.shape, generator=gen) < 0.25
    up = torch.rand(values.shape, generator=gen) < 0.5
    v = values.detach()
    target = torch.where(up, torch.full_like(v, float("inf")), torch.full_like(v, -float("inf")))
    moved = torch.where(pick, torch.nextafter(v, target), v)
    return values + (moved - v)


def _check(
    program: Program, batch: Batch, map_fn: MapFn, caught: list[str], nudge: int = 0
) -> None:
    """Raise ``_Found`` on the first difference; ``nudge`` > 0: the loop runs on inputs one
    ulp away in places (see ``_nudged``), map on the batch itself."""
    f = program.function()
    random_program = "random" in program.tags()
    template = batch.ragged()
    leaf = template.values.detach().clone().requires_grad_()
    p0 = params()
    p_loop = {**p0, "buf": p0["buf"].clone()}
    p_map = {**p0, "buf": p0["buf"].clone()}
    loop_values = _nudged(leaf * 1, nudge) if nudge else leaf * 1
    loop_inputs = samples(template.with_values(loop_values))

    torch.manual_seed(batch.seed)
    expected, loop_error = _call(lambda: [f(s, p_loop) for s in loop_inputs], caught)
    x = template.with_values(leaf * 1)
    snapshot, version = x.values.detach().clone(), x.values._version
    torch.manual_seed(batch.seed)
    out, map_error = _call(lambda: map_fn(f, x, p_map, in_dims=(0, None)), caught)

    if x.values._version != version or not torch.equal(x.values.detach(), snapshot):
        raise _Found("caller-mutated", "map changed the caller's packed values")
    if loop_error is not None:
        if map_error is not None:
            raise _Found(
                "both-raised",
                f"loop {type(loop_error).__name__}; map {_describe_error(map_error)}",
            )
        if any(word in str(loop_error) for word in _EMPTY_REDUCTION):
            raise _Found("empty-reduction", f"loop {_describe_error(loop_error)}")
        raise _Found("loop-raised", f"loop {_describe_error(loop_error)}; map returned")
    if map_error is not None:
        kind = "refused" if isinstance(map_error, raggedfn.RaggedError) else "crash"
        raise _Found(kind, _describe_error(map_error))
    if not expected:
        return  # B = 0: nothing to compare the output with
    flat = [pytree.tree_flatten(e) for e in expected]
    spec = flat[0][1]
    got, got_spec = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, raggedfn.Ragged))
    if got_spec != spec:
        raise _Found("type", f"output structure {got_spec} vs loop {spec}")
    columns = [list(c) for c in zip(*(leaves for leaves, _ in flat), strict=True)]
    for j, (g, column) in enumerate(zip(got, columns, strict=True)):
        _compare_leaf(g, column, f"output {j}", values=not random_program)
    if not random_program and not _same_state(p_map["buf"], p_loop["buf"]):
        raise _Found(
            "shared-state",
            f"shared buf after map {p_map['buf'].tolist()} vs loop {p_loop['buf'].tolist()}",
        )
    if not random_program:
        _check_grads(got, [leaf for leaves, _ in flat for leaf in leaves], leaf, p0, caught)
    _check_kinds(f, batch, got, columns, map_fn, caught)
    if random_program:
        _check_noise(f, batch, map_fn, caught)


def _check_grads(
    got: list[Any], expected: list[Any], leaf: torch.Tensor, p0: dict[str, Any], caught: list[str]
) -> None:
    inputs = [leaf, *(p0[k] for k in GRAD_PARAMS)]
    want_loss = _loss(expected)
    if want_loss is None:
        return
    want, loop_error = _call(lambda: _grads(want_loss, inputs), caught)
    if loop_error is not None:
        return  # the loop cannot differentiate this program (e.g. an in-place write)
    got_loss = _loss(got)
    if got_loss is None:
        raise _Found("grad", "map's outputs do not require grad where the loop's do")
    have, map_error = _call(lambda: _grads(got_loss, inputs), caught)
    if map_error is not None:
        kind = "refused" if isinstance(map_error, raggedfn.RaggedError) else "crash"
        raise _Found(kind, f"backward: {_describe_error(map_error)}")
    for name, g, w in zip(("values", *GRAD_PARAMS), have, want, strict=True):
        try:
            torch.testing.assert_close(g, w, equal_nan=True)
        except AssertionError as error:
            lines = " ".join(str(error).splitlines()[:4])[:300]
            raise _Found("grad", f"d loss / d {name}: {lines}") from None


def _check_kinds(
    f: Any, batch: Batch, got: list[Any], columns: list[list[Any]], map_fn: MapFn, caught: list[str]
) -> None:
    """The output structure is decided by f, not by this batch's lengths.

    Compared with a batch whose samples all have sample 0's sizes (``equal``), per
    tensor output: where f's output shape follows the input sizes (the loop on larger
    samples, ``_follows_sizes``) both batches give a Ragged; elsewhere both give the
    same kind, except that a batch whose samples' shapes differ (a Python branch on
    sizes choosing a fixed size, ``t[: min(1, n)]``) gives a Ragged, as it must."""
    if len(set(batch.sizes)) < 2:
        return
    equal = Batch(batch.input_kind, (batch.sizes[0],) * 2, batch.seed)
    p = params()
    torch.manual_seed(batch.seed)
    if map_fn is raggedfn.map:
        report, error = _call(
            lambda: raggedfn.map_report(f, equal.ragged(), p, in_dims=(0, None)), caught
        )
        if report is not None and report.structure is None:
            # documented limit (docs/map.md, Known limits): f could not be traced to
            # its end (a map nested in f), so the loop's outputs decide the kind
            return
        out = None if report is None else report.output
    else:
        out, error = _call(lambda: map_fn(f, equal.ragged(), p, in_dims=(0, None)), caught)
    if error is not None:
        return
    leaves, _ = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, raggedfn.Ragged))
    if len(leaves) != len(got):
        raise _Found("type", "the output structure changed with equal lengths")
    follows = _follows_sizes(f, batch, caught)
    for j, (a, b, column) in enumerate(zip(got, leaves, columns, strict=True)):
        if not all(isinstance(c, torch.Tensor) for c in column):
            continue
        ragged_a, ragged_b = isinstance(a, raggedfn.Ragged), isinstance(b, raggedfn.Ragged)
        where = f"output {j} is {_brief(a)} for sizes {list(batch.sizes)} and {_brief(b)} for sizes {list(equal.sizes)}"
        if follows is not None and follows[j]:
            if not (ragged_a and ragged_b):
                raise _Found("type", f"{where}, but its shape follows the input sizes")
        elif ragged_a != ragged_b and len({tuple(c.shape) for c in column}) == 1:
            raise _Found("type", where)


def _follows_sizes(f: Any, batch: Batch, caught: list[str]) -> list[bool] | None:
    """Per flat output of the loop: does its shape change when sample 0 grows (by 2
    and by 3 along every ragged axis)? None when the loop fails on those samples."""
    grown = Batch(
        batch.input_kind, tuple(tuple(n + k for n in batch.sizes[0]) for k in (2, 3)), batch.seed
    )
    shapes = []
    for sample in grown.samples():
        torch.manual_seed(batch.seed)
        out, error = _call(lambda s=sample: f(s, params()), caught)
        if error is not None:
            return None
        shapes.append(
            [
                tuple(v.shape) if isinstance(v, torch.Tensor) else None
                for v in pytree.tree_leaves(out)
            ]
        )
    if len(shapes[0]) != len(shapes[1]):
        return None
    return [s0 != s1 for s0, s1 in zip(shapes[0], shapes[1], strict=True)]


def _check_noise(f: Any, batch: Batch, map_fn: MapFn, caught: list[str], copies: int = 8) -> None:
    """randomness="different": copies of one sample get independent noise, as in the loop."""
    if not batch.sizes:
        return
    one = Batch(batch.input_kind, batch.sizes[:1], batch.seed)
    runs = []
    for seed in range(copies):
        torch.manual_seed(seed)
        result, error = _call(lambda: f(one.samples()[0], params()), caught)
        if error is not None:
            return
        runs.append(pytree.tree_flatten(result)[0])
    same = Batch(batch.input_kind, batch.sizes[:1] * copies, batch.seed)
    torch.manual_seed(copies)
    out, error = _call(lambda: map_fn(f, _copies(same), params(), in_dims=(0, None)), caught)
    if error is not None:
        if not isinstance(error, raggedfn.RaggedError):
            raise _Found("crash", f"on {copies} copies of sample 0: {_describe_error(error)}")
        return
    got, _ = pytree.tree_flatten(out, is_leaf=lambda v: isinstance(v, raggedfn.Ragged))
    for j, g in enumerate(got):
        loop_keys = {_key(run[j]) for run in runs}
        if len(loop_keys) < copies or not isinstance(runs[0][j], torch.Tensor):
            continue  # the loop's own draws collide: too little noise to judge
        parts = _per_sample(g, copies, f"output {j}")
        if len({_key(part) for part in parts}) == 1:
            raise _Found(
                "random",
                f"output {j}: {copies} copies of one sample got identical noise "
                "(the loop's draws all differ)",
            )


def _copies(batch: Batch) -> raggedfn.Ragged:
    first = batch.samples()[0]
    dims = (1,) if batch.input_kind == "tok" else (1, 2)
    return raggedfn.from_list([first.clone() for _ in batch.sizes], ragged_dims=dims)


def loop_map(f: Any, x: raggedfn.Ragged, p: Any, in_dims: Any = (0, None)) -> Any:
    """The contract written out as code, to test the oracle itself: ``f`` on a copy of
    each sample (the caller's values are never written), outputs restacked with every
    axis of a tensor output ragged (so the kind never depends on the lengths) and
    per-sample numbers as ``[B]`` tensors."""
    assert in_dims == (0, None)
    outs = [f(s.clone(), p) for s in samples(x)]
    if not outs:
        raise raggedfn.RaggedError("loop_map: an empty batch has no output structure")
    flat = [pytree.tree_flatten(o) for o in outs]
    packed = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        if not all(isinstance(c, torch.Tensor) for c in column):
            packed.append(torch.tensor(column))
        elif column[0].ndim == 0:
            packed.append(torch.stack(column))
        else:
            packed.append(raggedfn.from_list(column, ragged_dims=range(1, column[0].ndim + 1)))
    return pytree.tree_unflatten(packed, flat[0][1])


def _same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shared state, NaN where the loop has NaN included (a mean of 0 rows)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--shrink-per-group", type=int, default=1)
    parser.add_argument("--shrink-first", type=int, default=60)
    parser.add_argument("--shrink-budget", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--workers", type=int, default=1, help="processes checking programs (one thread each)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from property_tests.map_runs import run_sharded

    summary = run_sharded(
        args.seed,
        args.programs,
        args.workers,
        min_steps=args.min_steps,
        max_steps=args.max_steps,
        shrink_per_group=args.shrink_per_group,
        shrink_first=args.shrink_first,
        shrink_budget=args.shrink_budget,
        progress=True,
    )
    print(summary.report())
    return 1 if summary.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
