"""Random per-sample programs for ``raggedfn.map``: the vocabulary, descriptions and source.

A :class:`Program` is a small description: the kind of sample it reads
(``"tok"`` ``(N, C)``, ``"pair"`` ``(N, M, C)``, ``"sq"`` ``(N, N, C)``) and a
tuple of steps ``(name, args)``. ``program.source()`` prints it as runnable
Python (``def f(t, p): ...``) and ``program.function()`` compiles exactly that
text, so every disagreement comes with its reproducer. A :class:`Batch` is the
matching small description of the inputs (per-sample sizes and a seed).

The state ``h`` of a program has a kind that each step's table entry checks:
``"tok"``, ``"pair"``, ``"sq"`` or ``"vec"`` (``(C,)``, after a reduction).
Emitting steps add an output ``o0, o1, ...`` (per-sample sizes, Python numbers,
integer counts, data-dependent selections, aliases of ``h``) without changing
``h``. Step arguments are drawn from small domains listed simplest first, so the
shrinker in ``map_search`` simplifies a step by trying earlier entries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import raggedfn

C = 2  # feature size of every state
RAGGED = frozenset({"tok", "pair", "sq"})
PAIRS = frozenset({"pair", "sq"})
ANY = RAGGED | {"vec"}
# tags: "random" (draws noise), "inplace" (writes a tensor), "datadep" (a size that
# depends on values), "raises" (the loop itself raises on short samples), "emit"
TAGS = ("random", "inplace", "datadep", "raises", "emit", "shared")


@dataclasses.dataclass(frozen=True)
class Op:
    """One vocabulary entry: which kinds it takes, the kind it gives, its source."""

    name: str
    takes: frozenset[str]
    render: Callable[..., list[str]]  # (args, kind, input_kind) -> lines
    gives: Callable[[str, str], str] | str | None = None  # None: the same kind
    domain: tuple[tuple[Any, ...], ...] = ()  # per argument, simplest first
    weight: float = 1.0
    tags: frozenset[str] = frozenset()

    def kind_after(self, kind: str, input_kind: str) -> str:
        if self.gives is None:
            return kind
        if isinstance(self.gives, str):
            return input_kind if self.gives == "input" else self.gives
        return self.gives(kind, input_kind)


VOCABULARY: dict[str, Op] = {}


def _op(
    name: str,
    takes: Any,
    render: Any,
    gives: Any = None,
    domain: Sequence[Sequence[Any]] = (),
    weight: float = 1.0,
    tags: Sequence[str] = (),
) -> None:
    if isinstance(render, str):
        template = render
        render = lambda args, kind, input_kind: template.format(*args, d=_rows(kind)).split("\n")  # noqa: E731
    assert name not in VOCABULARY, name
    assert all(t in TAGS for t in tags), tags
    VOCABULARY[name] = Op(
        name,
        frozenset(takes),
        render,
        gives,
        tuple(tuple(d) for d in domain),
        weight,
        frozenset(tags),
    )


def _rows(kind: str) -> str:
    """The reduction dims that remove every ragged axis of a state of ``kind``."""
    return "(0, 1)" if kind in PAIRS else "0"


def _bound(v: Any) -> str:
    return "" if v is None else str(v)


def _slice_text(a: Any, b: Any, s: Any) -> str:
    return f"{_bound(a)}:{_bound(b)}" + ("" if s is None else f":{s}")


def _slice_kind(kind: str, input_kind: str) -> str:
    return "pair" if kind == "sq" else kind


BOUNDS = (None, 0, 1, -1, 2, -2, 3, -3)
SMALL = (0, 1, 2, 3)

# ----- pointwise and the earlier vocabulary (any kind) ---------------------------------
_op("relu", ANY, "h = h.relu()", weight=2)
_op("tanh_affine", ANY, "h = torch.tanh(h * 0.5 + 1)")
_op("square", ANY, "h = h * h - h")
_op("gelu", ANY, "h = F.gelu(h)", weight=0.5)
_op("linear", ANY, 'h = F.linear(h, p["w"], p["b"])', weight=2)
_op("layer_norm", ANY, f'h = F.layer_norm(h, ({C},), p["g"], p["b"])')
_op("rms_norm", ANY, f'h = F.rms_norm(h, ({C},), p["g"])', weight=1.5)
_op(
    "vector_normalize",
    ANY,
    "h = h / torch.linalg.vector_norm(h, {0}, dim=-1, keepdim=True).clamp_min(0.1)",
    domain=[(2, 1)],
)
_op("log_softmax_features", ANY, "h = F.log_softmax(h, -1)", weight=0.5)
_op("masked_fill", ANY, "h = h.masked_fill(h > 1, 0.0)", weight=0.5)
_op("dropout_eval", ANY, "h = F.dropout(h, 0.5, training=False)", weight=0.5)
_op("cat_features", ANY, 'h = F.linear(torch.cat([h, h.sin()], -1), p["w2"])', weight=0.5)

# ----- token states (N, C) --------------------------------------------------------------
_op("softmax_rows", {"tok"}, "h = h.softmax(0) * 2")
_op("center", {"tok"}, "h = h - h.mean(0, keepdim=True)")
_op("sub_logsumexp", {"tok"}, "h = h - h.logsumexp(0, keepdim=True)", weight=0.5)
_op("attention", {"tok"}, "h = F.scaled_dot_product_attention(h[None], h[None], h[None])[0]")
_op(
    "attention_causal",
    {"tok"},
    "h = F.scaled_dot_product_attention(h[None], h[None], h[None], is_causal=True)[0]",
    weight=0.5,
)
_op(
    "attention_sliced_queries",
    {"tok"},
    "h = F.scaled_dot_product_attention(h[{0}:{1}][None], h[None], h[None])[0]",
    domain=[(1, 0, 2), (-1, None, -2)],
    weight=0.5,
)
_op("attention_by_hand", {"tok"}, "h = torch.softmax(h @ h.T / 1.5, -1) @ h", weight=0.5)
_op("cat_row", {"tok"}, 'h = torch.cat([p["row"][None], h], 0)')
_op("gram", {"tok"}, "h = h @ (h.T @ h) / 10", weight=0.5)
_op("cumsum", {"tok"}, "h = h.cumsum(0) / 4")
_op("transpose_roundtrip", {"tok"}, 'h = (h.T * p["g"][:, None]).T', weight=0.5)
_op(
    "pair_roundtrip",
    {"tok"},
    "h = ((h[:, None, :] * h[None, :, :]).softmax(1) * h[None, :, :]).sum(1)",
    weight=0.5,
)
_op("flip", {"tok"}, "h = h.flip(0)", weight=0.5)
_op("nested_map", {"tok"}, "h = raggedfn.map(lambda r: r * 2 + 1, h)", weight=0.3)

# slices, narrow, select and index arithmetic along the (first) ragged axis
_op(
    "slice",
    RAGGED,
    lambda a, kind, ik: [f"h = h[{_slice_text(*a)}]"],
    gives=_slice_kind,
    domain=[BOUNDS, BOUNDS, (None, None, 2, 3)],
    weight=4,
)
_op(
    "slice_cols",
    PAIRS,
    lambda a, kind, ik: [f"h = h[:, {_slice_text(*a)}]"],
    gives="pair",
    domain=[BOUNDS, BOUNDS, (None, None, 2)],
    weight=1,
)
_op(
    "slice_chain",
    {"tok"},
    lambda a, kind, ik: [
        f"h = h[{_slice_text(a[0], a[1], None)}][{_slice_text(a[2], a[3], None)}]"
    ],
    domain=[BOUNDS, BOUNDS, BOUNDS, BOUNDS],
    weight=2,
)
_op("narrow_clamped", RAGGED, "h = h.narrow(0, 0, min({0}, h.shape[0]))", _slice_kind, [SMALL])
_op(
    "narrow",
    RAGGED,
    "h = h.narrow(0, {0}, {1})",
    _slice_kind,
    [SMALL, SMALL],
    weight=0.5,
    tags=["raises"],
)
_op("select", {"tok"}, "h = h[{0}]", "vec", [(0, -1, 1, 2)], weight=0.5, tags=["raises"])
_op(
    "select_guarded",
    {"tok"},
    lambda a, kind, ik: [f"h = h[{a[0]}] if h.shape[0] > {max(a[0], 0)} else h.sum(0)"],
    "vec",
    [(0, -1, 1, 2)],
    weight=1.5,
)
_op(
    "shift_right",
    {"tok"},
    "h = torch.cat([torch.zeros_like(h[:{0}]), h[:-{0}]], 0)",
    domain=[(1, 2)],
    weight=2,
)
_op(
    "shift_left",
    {"tok"},
    "h = torch.cat([h[{0}:], torch.zeros_like(h[:{0}])], 0)",
    domain=[(1, 2)],
    weight=1,
)
_op("roll_cat", {"tok"}, "h = torch.cat([h[{0}:], h[:{0}]], 0)", domain=[(1, 2, -1)])
_op("edge_row_broadcast", {"tok"}, "h = h - 0.5 * h[{0}]", domain=[(":1", "-1:", "1:2")])
_op("double_cat", {"tok"}, "h = torch.cat([h, h * 0.5], 0)", weight=0.7)
_op(
    "roll_index",
    {"tok"},
    "h = h[(torch.arange(h.shape[0]) + {0}) % h.shape[0]]",
    domain=[(1, 2, -1)],
    weight=2,
)
_op("reverse_index", {"tok"}, "h = h[torch.arange(h.shape[0] - 1, -1, -1)]", weight=0.7)
_op("even_rows", {"tok"}, "h = h[torch.arange(0, h.shape[0], 2)]", weight=0.7)

# Python branches and Python numbers computed from sizes
COMPARISONS = (">", ">=", "==", "!=", "<", "<=")
_op(
    "branch_size",
    RAGGED,
    "h = h * 2 + 1 if h.shape[0] {0} {1} else h - 1",
    domain=[COMPARISONS, SMALL],
    weight=3,
)
_op(
    "branch_ops",
    {"tok"},
    "h = h.softmax(0) if h.shape[0] {0} {1} else h.relu()",
    domain=[COMPARISONS, SMALL],
    weight=1,
)
_op(
    "branch_numel",
    RAGGED,
    "h = h.cumsum(0) if h.numel() {0} 0 else h + 1",
    domain=[(">", "==", "!=")],
    weight=1.5,
)
# a branch on the input's size changes a value that is not empty for an empty sample
_op(
    "branch_input_size",
    ANY,
    "h = h * 2 + 1 if t.shape[0] {0} {1} else h - 1",
    domain=[COMPARISONS, SMALL],
    weight=1.5,
)
_op(
    "emit_branch",
    RAGGED,
    "{{o}} = h.sum() + 1 if h.{0} else h.sum() - 1",
    domain=[
        (
            "shape[0] > 0",
            "shape[0] == 0",
            "shape[0] >= 1",
            "shape[0] != 0",
            "numel() > 0",
            "shape[0] > 1",
            "shape[0] < 3",
        )
    ],
    tags=["emit"],
)
_op(
    "branch_cols",
    PAIRS,
    "h = h + 1 if h.shape[1] {0} {1} else h * 0.5",
    domain=[COMPARISONS, SMALL],
)
SCALINGS = (
    "h * h.shape[0]",
    "h / max(h.shape[0], 1)",
    "h * (h.shape[0] // 2)",
    "h + float(h.shape[0]) / 3",
    "h * len(h)",
    "h * (h.shape[0] % 3)",
)
_op("scale_by_size", RAGGED, "h = {0}", domain=[SCALINGS], weight=1.5)

# data-dependent sizes
MASKS = ("h[:, 0] > 0", "h.sum(-1) > 0.5", "(h > 0).all(-1)")
_op("mask_rows", {"tok"}, "h = h[{0}]", domain=[MASKS], weight=1.5, tags=["datadep"])
_op(
    "nonzero_rows",
    {"tok"},
    "h = h.index_select(0, torch.nonzero(h[:, 0] > 0)[:, 0])",
    weight=0.7,
    tags=["datadep"],
)

# ----- reductions -----------------------------------------------------------------------
_op("sum", RAGGED, "h = h.sum({d})", "vec", weight=1.5)
_op("mean", RAGGED, "h = h.mean({d})", "vec")
_op("logsumexp", RAGGED, "h = h.logsumexp({d})", "vec", weight=0.5)
_op(
    "amax_guarded",
    {"tok"},
    "h = h.new_zeros(2) if h.shape[0] == 0 else h.amax(0)",
    "vec",
)
_op("amax", RAGGED, "h = h.amax({d})", "vec", weight=0.3, tags=["raises"])
_op("max_values", {"tok"}, "h = h.max(0).values", "vec", weight=0.3, tags=["raises"])
_op(
    "bool_sum",
    RAGGED,
    "h = (h > {0}).sum({d}).to(h.dtype)",
    "vec",
    domain=[(0, -100, 0.5)],
    weight=2,
)
_op("count_nonzero", RAGGED, "h = torch.count_nonzero(h > 0, {d}).to(h.dtype)", "vec")
_op("bool_any", {"tok"}, "h = (h > 0).{0}(0).to(h.dtype)", "vec", domain=[("any", "all")])
_op("vector_norm_rows", RAGGED, "h = torch.linalg.vector_norm(h, dim={d})", "vec", weight=0.7)
_op("attention_pool", {"tok"}, "h = (h.softmax(0) * h).sum(0)", "vec", weight=0.7)

# ----- pairs ------------------------------------------------------------------------------
_op("to_pair", {"tok"}, "h = h[:, None, :] * h[None, :, :]", "sq", weight=1)
_op("to_pair_sliced", {"tok"}, "h = h[:, None, :] + h[None, {0}:, :]", "pair", [(1, 2)], 0.5)
_op("softmax_cols", PAIRS, "h = h.softmax(1)")
_op("transpose_add", {"sq"}, "h = h + h.transpose(0, 1)")
_op("pair_mean_add", PAIRS, "h = h + h.mean(0, keepdim=True)", weight=0.7)
_op("triangle", {"sq"}, 'h = torch.einsum("ikc,jkc->ijc", h, h) / 4', weight=0.5)
_op("pair_sum_cols", PAIRS, "h = h.sum(1)", "tok")
_op("pair_mean_rows", PAIRS, "h = h.mean(0)", "tok", weight=0.5)

# ----- back from a reduction --------------------------------------------------------------
_op("rebroadcast", {"vec"}, "h = t * h", "input", weight=1.5)
_op("softmax_features", {"vec"}, "h = h.softmax(-1)", weight=0.5)

# ----- randomness ------------------------------------------------------------------------
_op("rand_like", ANY, "h = h + torch.rand_like(h)", tags=["random"])
_op("rand_shared_shape", ANY, f"h = h + torch.rand({C}, dtype=h.dtype)", tags=["random"])
_op(
    "randn_rows",
    {"tok"},
    "h = h * torch.randn(h.shape[0], 1, dtype=h.dtype)",
    weight=0.5,
    tags=["random"],
)
_op("dropout_train", ANY, "h = F.dropout(h, 0.5, training=True)", tags=["random"])
_op(
    "bernoulli",
    ANY,
    "h = h * torch.bernoulli(torch.full_like(h, 0.5))",
    weight=0.5,
    tags=["random"],
)

# ----- in-place writes (on whatever h is: a fresh value, a view of one, or the input) -----
_op("add_", ANY, "h.add_(0.25)", weight=1.5, tags=["inplace"])
_op("relu_", ANY, "h.relu_()", tags=["inplace"])
_op("iadd", ANY, "h += 1", weight=0.5, tags=["inplace"])
_op("fresh_add_", ANY, "h = h * 1.5\nh.add_(0.5)", tags=["inplace"])
_op("fresh_relu_", ANY, "h = h - 0.25\nh.relu_()", weight=0.7, tags=["inplace"])
_op("first_row_mul_", RAGGED, "h[:1].mul_(2)", tags=["inplace"])
_op("setitem_rows", RAGGED, "h[{0}] = 0.5", domain=[(":1", "-1:", "1:", "::2")], tags=["inplace"])
_op(
    "setitem_first",
    {"tok"},
    "h = h.clone()\nif h.shape[0] > 0:\n    h[0] = h[0] * 3",
    tags=["inplace"],
)
_op("column_mul_", ANY, "h[..., 0].mul_(2)", weight=0.7, tags=["inplace"])
_op("input_add_", ANY, "t.add_(0.5)", weight=0.7, tags=["inplace"])
_op("shared_count_", ANY, 'p["buf"].add_(1)', weight=0.7, tags=["inplace", "shared"])
_op(
    "shared_accumulate_",
    RAGGED,
    'p["buf"].add_(h.detach().sum({d}))',
    weight=0.5,
    tags=["inplace", "shared"],
)
_op("read_shared", ANY, 'h = h + p["buf"]', weight=0.7)

# ----- emitted outputs (h unchanged) -------------------------------------------------------
ROW_EXPRESSIONS = (
    "h.shape[0]",
    "h[:-1].shape[0]",
    "h[::2].shape[0]",
    "h[1:].shape[0]",
    "h[:2].shape[0]",
    "h[-2:].shape[0]",
    "h.shape[0] * 2 - 1",
    "len(h) // 2",
)
_op("emit_rows", RAGGED, "{{o}} = {0}", domain=[ROW_EXPRESSIONS], weight=2, tags=["emit"])
_op(
    "emit_number",
    ANY,
    "{{o}} = {0}",
    domain=[("h.shape[-1]", "3", "0.5", "h.shape[0] / 2", "float(h.shape[0])", "h.shape[0] > 1")],
    tags=["emit"],
)
_op("emit_numel", RAGGED, "{{o}} = h.numel()", weight=0.5, tags=["emit"])
_op("emit_bool_count", RAGGED, "{{o}} = (h > 0).sum(0)", tags=["emit"])
_op("emit_bool_total", ANY, "{{o}} = (h > 0).sum()", weight=0.5, tags=["emit"])
_op("emit_nonzero", {"tok"}, "{{o}} = torch.nonzero(h[:, 0] > 0)", tags=["emit", "datadep"])
_op("emit_masked_select", ANY, "{{o}} = torch.masked_select(h, h > 0)", tags=["emit", "datadep"])
_op(
    "emit_unique",
    {"tok"},
    "{{o}} = torch.unique((h > 0).sum(-1))",
    weight=0.5,
    tags=["emit", "datadep"],
)
_op("emit_alias", ANY, "{{o}} = h", tags=["emit"])
_op("emit_copy", ANY, "{{o}} = h * 1", weight=0.5, tags=["emit"])


# ----- programs ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
    """``input_kind`` and ``steps``: a tuple of ``(name, args)``."""

    input_kind: str
    steps: tuple[tuple[str, tuple[Any, ...]], ...]

    def kinds(self) -> list[str] | None:
        """The state's kind before and after each step; None if a step does not fit."""
        kind = self.input_kind
        out = [kind]
        for name, _ in self.steps:
            op = VOCABULARY[name]
            if kind not in op.takes:
                return None
            kind = op.kind_after(kind, self.input_kind)
            out.append(kind)
        return out

    def tags(self) -> frozenset[str]:
        return frozenset().union(*(VOCABULARY[name].tags for name, _ in self.steps))

    def body(self) -> list[str]:
        kinds = self.kinds()
        assert kinds is not None, self
        lines = ["h = t"]
        emitted = 0
        for (name, args), kind in zip(self.steps, kinds, strict=False):
            for line in VOCABULARY[name].render(args, kind, self.input_kind):
                if "{o}" in line:
                    line = line.replace("{o}", f"o{emitted}")
                    emitted += 1
                lines.append(line)
        outputs = ["h", *(f"o{k}" for k in range(emitted))]
        lines.append("return " + ", ".join(outputs))
        return lines

    def source(self) -> str:
        return "def f(t, p):\n" + "".join(f"    {line}\n" for line in self.body())

    def function(self) -> Callable[..., Any]:
        """The compiled source. The file name is a digest of the source: equal names
        mean equal code (``map`` keys its trace cache partly on the code location)."""
        text = self.source()
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        namespace: dict[str, Any] = {"torch": torch, "F": F, "raggedfn": raggedfn}
        exec(compile(text, f"<map_program {digest}>", "exec"), namespace)
        return namespace["f"]

    def __str__(self) -> str:
        return self.source()


def draw_program(rng: random.Random, min_steps: int = 2, max_steps: int = 6) -> Program:
    """A random well-kinded program. Programs with random steps have no data-dependent
    sizes (the oracle then compares shapes with the loop and checks the noise)."""
    input_kind = rng.choices(("tok", "pair", "sq"), (0.76, 0.12, 0.12))[0]
    count = rng.randint(min_steps, max_steps)
    steps: list[tuple[str, tuple[Any, ...]]] = []
    kind = input_kind
    tags: set[str] = set()
    for _ in range(count):
        options = [
            op
            for op in VOCABULARY.values()
            if kind in op.takes
            and not ("random" in op.tags and "datadep" in tags)
            and not ("datadep" in op.tags and "random" in tags)
        ]
        op = rng.choices(options, [o.weight for o in options])[0]
        args = tuple(rng.choice(d) for d in op.domain)
        steps.append((op.name, args))
        tags |= op.tags
        kind = op.kind_after(kind, input_kind)
    return Program(input_kind, tuple(steps))


# ----- inputs -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """Per-sample ragged sizes (one tuple per sample) and the seed of the values."""

    input_kind: str
    sizes: tuple[tuple[int, ...], ...]
    seed: int

    def samples(self) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randn(*s, C, generator=gen, dtype=torch.float64) for s in self.sizes]

    def ragged(self) -> raggedfn.Ragged:
        dims = (1,) if self.input_kind == "tok" else (1, 2)
        samples = self.samples()
        if not samples:
            num = len(dims)
            return raggedfn.from_sizes(
                torch.zeros(0, C, dtype=torch.float64),
                torch.zeros(0, num, dtype=torch.int64),
            )
        return raggedfn.from_list(samples, ragged_dims=dims)

    def source(self) -> str:
        dims = "" if self.input_kind == "tok" else ", ragged_dims=(1, 2)"
        sizes = [list(s) for s in self.sizes]
        return (
            f"gen = torch.Generator().manual_seed({self.seed})\n"
            f"samples = [torch.randn(*s, {C}, generator=gen, dtype=torch.float64) "
            f"for s in {sizes}]\n"
            f"x = raggedfn.from_list(samples{dims})\n"
        )


def draw_batch(rng: random.Random, input_kind: str, max_batch: int = 4) -> Batch:
    """B in 0..max_batch (mostly 1..4); sizes 0..3 half of the time, else 0..12
    (pairs 0..5); sometimes all equal, often with an empty sample."""
    roll = rng.random()
    batch = 0 if roll < 0.02 else 1 if roll < 0.15 else rng.randint(2, max_batch)
    top = 12 if input_kind == "tok" else 5

    def size() -> int:
        return rng.randint(0, 3) if rng.random() < 0.5 else rng.randint(0, top)

    num = 1 if input_kind == "tok" else 2
    rows = [tuple(size() for _ in range(num)) for _ in range(batch)]
    if input_kind == "sq":
        rows = [(r[0], r[0]) for r in rows]
    if rows and rng.random() < 0.15:
        rows = [rows[0]] * batch
    elif rows and rng.random() < 0.3:
        rows[rng.randrange(batch)] = (0,) * num
    return Batch(input_kind, tuple(rows), rng.randrange(2**31))


def params() -> dict[str, torch.Tensor]:
    """Shared arguments (``in_dims=None``): leaves that require grad, and ``buf``."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"w": (C, C), "b": (C,), "g": (C,), "w2": (C, 2 * C), "row": (C,)}
    out = {
        k: (torch.randn(*s, generator=gen, dtype=torch.float64) / 2).requires_grad_()
        for k, s in shapes.items()
    }
    out["buf"] = torch.zeros(C, dtype=torch.float64)
    return out


PARAMS_SOURCE = (
    "gen = torch.Generator().manual_seed(0)\n"
    "p = {k: (torch.randn(*s, generator=gen, dtype=torch.float64) / 2).requires_grad_()\n"
    f'     for k, s in {{"w": ({C}, {C}), "b": ({C},), "g": ({C},), "w2": ({C}, {2 * C}), '
    f'"row": ({C},)}}.items()}}\n'
    f'p["buf"] = torch.zeros({C}, dtype=torch.float64)\n'
)


def reproducer(program: Program, batch: Batch) -> str:
    """A runnable script: the program, its inputs, ``map`` and the loop side by side."""
    return (
        "import torch\nimport torch.nn.functional as F\n\nimport raggedfn\n\n\n"
        + program.source()
        + "\n\n"
        + batch.source()
        + PARAMS_SOURCE
        + "print(raggedfn.map(f, x, p, in_dims=(0, None)))\n"
        + "print([f(s.clone(), p) for s in samples])\n"
    )


def program_stream(seed: int, count: int, min_steps: int = 2, max_steps: int = 6, start: int = 0):
    """``count`` (index, program, batch) from index ``start`` on: program ``i`` of ``seed``
    depends on nothing else (a run split in parts checks the same programs)."""
    for index in range(start, start + count):
        rng = random.Random(f"{seed}:{index}")
        program = draw_program(rng, min_steps, max_steps)
        yield index, program, draw_batch(rng, program.input_kind)


__all__ = [
    "C",
    "VOCABULARY",
    "Batch",
    "Op",
    "Program",
    "draw_batch",
    "draw_program",
    "params",
    "program_stream",
    "reproducer",
]
