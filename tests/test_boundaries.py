"""The value is sound at every boundary: construction, save/load, pytrees, treespecs,
eager error messages, the logsumexp/softmax policy on -inf rows, and the layering.

Compiled boundaries (errors under torch.compile, axes as arguments, operators with
tensors) are in ``test_boundaries_compile.py``.
"""

from __future__ import annotations

import ast
import copy
import io
import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import optree
import pytest
import torch
import torch.utils._pytree as pytree

import raggedfn
from raggedfn import Axis, Layout, Ragged, RaggedError

I64 = torch.int64
PACKAGE = Path(raggedfn.__file__).parent


def tokens(lengths=(2, 0, 3), dim=3, seed=0) -> Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), dim, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=I64))


def pairs(sizes=(2, 3), channels=2) -> Ragged:
    gen = torch.Generator().manual_seed(1)
    return raggedfn.from_list(
        [torch.randn(n, n, channels, generator=gen, dtype=torch.float64) for n in sizes],
        ragged_dims=(1, 2),
    )


def images() -> Ragged:
    """``[C, H*, W*]``: a non-standard layout (channel axis stored last)."""
    gen = torch.Generator().manual_seed(2)
    return raggedfn.from_list(
        [torch.randn(3, 2, 4, generator=gen), torch.randn(3, 5, 1, generator=gen)],
        ragged_dims=(2, 3),
    )


def same(a: Ragged, b: Ragged) -> bool:
    return (
        a.layout == b.layout
        and torch.equal(a.values, b.values)
        and torch.equal(a.offsets, b.offsets)
        and torch.equal(a.sizes, b.sizes)
    )


# ----- constructors own their partitions ------------------------------------------


def _constructors():
    values = torch.arange(15.0).reshape(5, 3)
    return [
        ("from_lengths", lambda t: raggedfn.from_lengths(values, t), torch.tensor([2, 0, 3])),
        ("from_offsets", lambda t: raggedfn.from_offsets(values, t), torch.tensor([0, 2, 2, 5])),
        ("from_sizes", lambda t: raggedfn.from_sizes(values, t), torch.tensor([[2], [0], [3]])),
        (
            "from_sizes R=2",
            lambda t: raggedfn.from_sizes(torch.arange(13.0), t),
            torch.tensor([[2, 2], [3, 3]]),
        ),
        (
            "from_padded",
            lambda t: raggedfn.from_padded(torch.arange(12.0).reshape(3, 4), t),
            torch.tensor([2, 0, 3]),
        ),
        (
            "from_padded sizes",
            lambda t: raggedfn.from_padded(torch.arange(18.0).reshape(2, 3, 3), t, (1, 2)),
            torch.tensor([[2, 2], [3, 1]]),
        ),
        (
            "from_nested",
            lambda t: raggedfn.from_nested(torch.nested.nested_tensor_from_jagged(values, t)),
            torch.tensor([0, 2, 2, 5]),
        ),
    ]


@pytest.mark.parametrize(
    ("name", "build", "index"), _constructors(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_caller_edits_of_the_index_tensor_do_not_change_the_value(name, build, index):
    x = build(index)
    before = copy.deepcopy((x.offsets, x.sizes))
    total = raggedfn.sum(x, tuple(x.ragged_dims))
    index.add_(1)  # the caller reuses its tensor in place
    index.mul_(2)
    assert torch.equal(x.offsets, before[0]) and torch.equal(x.sizes, before[1])
    torch.testing.assert_close(raggedfn.sum(x, tuple(x.ragged_dims)), total)


def test_values_stay_zero_copy():
    values = torch.arange(15.0).reshape(5, 3)
    assert raggedfn.from_lengths(values, torch.tensor([2, 3])).values is values
    assert raggedfn.from_offsets(values, torch.tensor([0, 5])).values is values
    assert raggedfn.from_sizes(values, torch.tensor([[5]])).values is values


def test_to_nested_does_not_share_the_partition():
    x = tokens()
    offsets = x.offsets.clone()
    njt = raggedfn.to_nested(x)
    assert njt.values().data_ptr() == x.values.data_ptr()  # values are shared, as documented
    njt.offsets().add_(1)
    assert torch.equal(x.offsets, offsets)


# ----- torch.save / torch.load ----------------------------------------------------


def _round_trip(obj, **kwargs):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, **kwargs)


@pytest.mark.parametrize("make", [tokens, pairs, images, lambda: tokens(())])
def test_save_and_load_with_torch_defaults(make):
    x = make()
    loaded = _round_trip(x)  # weights_only=True, torch's default
    assert isinstance(loaded, Ragged) and same(loaded, x)
    nested = _round_trip({"batch": [x, x], "step": 3})
    assert same(nested["batch"][1], x) and nested["step"] == 3


def test_safe_globals_are_registered_on_import():
    allowed = torch.serialization.get_safe_globals()
    assert {Ragged, Layout, Axis} <= set(allowed)
    assert _round_trip(Axis(True, 0)) == Axis(True, 0)
    assert _round_trip(Layout("d0 r0")) == Layout("d0 r0")


def _crafted(values, offsets, sizes, layout) -> Ragged:
    """A value no constructor would build (as a hand-edited or corrupted file holds)."""
    return Ragged._make(values, offsets, sizes, layout)


def _bad_layout(code: str) -> Layout:
    layout = object.__new__(Layout)
    object.__setattr__(layout, "code", code)
    return layout


STANDARD = Layout.standard(1, 1)
CRAFTED = [
    # offsets disagree with the values: eager sum would silently mix samples
    (
        (torch.ones(7, 3), torch.tensor([0, 2, 7]), torch.tensor([[3], [4]]), STANDARD),
        r"Ragged.__setstate__: sample 0 has sizes \[3\] \(product 3\) but offsets give it 2 rows",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 3, 6]), torch.tensor([[3], [3]]), STANDARD),
        r"Ragged.__setstate__: offsets must end at values.shape\[0\] = 7, got offsets\[-1\] = 6",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 5, 3, 7]), torch.tensor([[5], [-2], [4]]), STANDARD),
        r"Ragged.__setstate__: offsets must never decrease, got offsets\[1\] = 5 > offsets\[2\] = 3",
    ),
    (
        (torch.ones(7, 3), torch.tensor([1, 7]), torch.tensor([[6]]), STANDARD),
        r"Ragged.__setstate__: offsets must start at 0, got offsets\[0\] = 1",
    ),
    (
        (torch.ones(4), torch.tensor([0, 4]), torch.tensor([[-2, -2]]), Layout.standard(2, 0)),
        r"Ragged.__setstate__: sizes must be non-negative, got sizes\[0\] = \[-2, -2\]",
    ),
    # structure
    (
        (torch.ones(7, 3), torch.tensor([0.0, 7.0]), torch.tensor([[7]]), STANDARD),
        r"Ragged.__setstate__: expected offsets to be an int64 \[B \+ 1\] tensor, got a torch.float32",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 7]), torch.tensor([[7], [0]]), STANDARD),
        r"Ragged.__setstate__: expected sizes of shape \[B, R\] with B = len\(offsets\) - 1 = 1",
    ),
    (
        (torch.ones(7), torch.tensor([0, 7]), torch.tensor([[7]]), STANDARD),
        r"Ragged.__setstate__: expected values with 1 dense axes as the layout 'r0 d0' declares",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 7]), [[7]], STANDARD),
        r"Ragged.__setstate__: expected sizes to be a tensor, got list",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 7]), torch.tensor([[7]]), _bad_layout("r0 d1")),
        r"Layout.__setstate__: Layout: expected ragged and dense axes numbered 0..n-1 each, got 'r0 d1'",
    ),
    (
        (torch.ones(7, 3), torch.tensor([0, 7]), torch.tensor([[7]]), _bad_layout("q0 d0")),
        r"Layout: expected a code like 'r0 d0'",
    ),
]


@pytest.mark.parametrize(("parts", "message"), CRAFTED)
@pytest.mark.parametrize("load", ["torch.load", "weights_only=False", "pickle", "deepcopy"])
def test_crafted_files_and_copies_are_refused(parts, message, load):
    bad = _crafted(*parts)
    message = message.replace("Layout.__setstate__: ", "")
    with pytest.raises(RaggedError, match=message):
        if load == "torch.load":
            _round_trip(bad)
        elif load == "weights_only=False":
            _round_trip(bad, weights_only=False)
        elif load == "pickle":
            pickle.loads(pickle.dumps(bad))
        else:
            copy.deepcopy(bad)


def test_a_shallow_copy_is_the_value_itself():
    x = tokens()
    assert copy.copy(x) is x  # immutable: nothing to copy, nothing to re-check
    deep = copy.deepcopy(x)  # new tensors, checked like any unpickled value
    assert same(deep, x) and deep.values is not x.values


def test_a_crafted_file_would_otherwise_give_a_silently_wrong_sum():
    """Why the load check matters: the partition is what every op trusts."""
    values = torch.arange(7.0).unsqueeze(1)
    bad = _crafted(values, torch.tensor([0, 2, 7]), torch.tensor([[3], [4]]), STANDARD)
    good = raggedfn.from_lengths(values, torch.tensor([3, 4]))
    assert not torch.equal(raggedfn.sum(bad, 1), raggedfn.sum(good, 1))


def test_setstate_refuses_a_foreign_state():
    x = object.__new__(Ragged)
    with pytest.raises(RaggedError, match=r"Ragged.__setstate__: expected a dict with keys"):
        x.__setstate__({"values": torch.ones(1)})
    layout = object.__new__(Layout)
    with pytest.raises(RaggedError, match=r"Layout.__setstate__: expected \{'code': str\}"):
        layout.__setstate__({"code": "r0", "extra": 1})


# ----- pytrees ----------------------------------------------------------------------


def test_torch_pytree_round_trip_and_non_tensor_leaves():
    x = images()
    leaves, spec = pytree.tree_flatten(x)
    assert same(pytree.tree_unflatten(leaves, spec), x)
    shapes = pytree.tree_map(lambda t: tuple(t.shape), x)  # a structure holder, not a value
    assert shapes.offsets == (3,)


CORRUPT = [
    (2, lambda s: s[:, :1], r"expected sizes with 2 columns"),
    (1, lambda o: o.float(), r"expected offsets to be an int64 \[B \+ 1\] tensor"),
    (1, lambda o: o[:-1], r"expected sizes of shape \[B, R\] with B = len\(offsets\) - 1 = 1"),
    (0, lambda v: v[..., None], r"expected values with 1 dense axes"),
]


@pytest.mark.parametrize(("leaf", "corrupt", "message"), CORRUPT)
def test_torch_pytree_unflatten_checks_corrupted_leaves(leaf, corrupt, message):
    leaves, spec = pytree.tree_flatten([pairs()])
    leaves[leaf] = corrupt(leaves[leaf])
    with pytest.raises(RaggedError, match="tree_unflatten: " + message):
        pytree.tree_unflatten(leaves, spec)


@pytest.mark.parametrize(("leaf", "corrupt", "message"), CORRUPT)
def test_optree_unflatten_checks_corrupted_leaves(leaf, corrupt, message):
    leaves, spec = optree.tree_flatten([pairs()], namespace=raggedfn._ragged.OPTREE_NAMESPACE)
    assert len(leaves) == 3
    leaves[leaf] = corrupt(leaves[leaf])
    with pytest.raises(RaggedError, match="optree.tree_unflatten: " + message):
        optree.tree_unflatten(spec, leaves)


def test_cxx_pytree_unflatten_checks_leaves_in_a_fresh_process():
    """optree's "torch" namespace mirrors the torch registration (its unflatten too);
    a fresh process, since an earlier import elsewhere could hide a missing mirror."""
    code = textwrap.dedent(
        """
        import torch, raggedfn
        import torch.utils._cxx_pytree as cxx
        x = raggedfn.from_lengths(torch.ones(5, 2), [2, 3])
        leaves, spec = cxx.tree_flatten([x])
        assert len(leaves) == 3, leaves
        back = cxx.tree_unflatten(leaves, spec)[0]
        assert torch.equal(back.offsets, x.offsets)
        leaves[2] = leaves[2][:1]
        try:
            cxx.tree_unflatten(leaves, spec)
        except raggedfn.RaggedError as error:
            print("refused:", error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert (
        "refused: tree_unflatten: expected sizes of shape [B, R] with B = len(offsets) - 1 = 2"
        in done.stdout
    )


# ----- treespecs -------------------------------------------------------------------


def test_treespec_dumps_and_loads_round_trip():
    tree = {"tokens": tokens(), "images": [images(), pairs()], "step": torch.tensor(3)}
    leaves, spec = pytree.tree_flatten(tree)
    text = pytree.treespec_dumps(spec)
    assert "r0 r1 d0" in text and json.loads(text)  # the context is plain JSON
    loaded = pytree.treespec_loads(text)
    assert loaded == spec
    back = pytree.tree_unflatten(leaves, loaded)
    assert same(back["images"][0], tree["images"][0]) and same(back["tokens"], tree["tokens"])


def test_treespec_loads_refuses_a_bad_layout_code():
    text = pytree.treespec_dumps(pytree.tree_flatten(images())[1])
    with pytest.raises(RaggedError, match=r"Layout: expected ragged and dense axes numbered"):
        pytree.treespec_loads(text.replace("d0 r0 r1", "d0 r0 r7"))


# ----- eager messages ----------------------------------------------------------------


def test_matmul_names_the_inner_sizes_with_logical_shapes():
    x = tokens((2, 3), dim=4)
    with pytest.raises(
        RaggedError,
        match=r"matmul: expected b to have the inner size 4 of a along axis 0, got a of logical "
        r"shape \(B=2, N\*, 4\) and b of shape \(3, 5\)",
    ):
        x @ torch.ones(3, 5, dtype=torch.float64)
    with pytest.raises(
        RaggedError,
        match=r"matmul: expected b to have the inner size 5 of a, got a of shape \(2, 5\) and b "
        r"of logical shape \(B=2, 4, N\*\)",
    ):
        torch.ones(2, 5, dtype=torch.float64) @ raggedfn.transpose(x, 1, 2)
    with pytest.raises(
        RaggedError,
        match=r"matmul: expected the other operand to be Ragged since b of logical shape "
        r"\(B=2, N\*, 4\) has a ragged contracted axis, got a torch.float64 tensor",
    ):
        torch.ones(2, 3, dtype=torch.float64) @ x


@pytest.mark.parametrize(
    "call",
    [
        lambda x: raggedfn.amax(x, 1),
        lambda x: raggedfn.amin(x),
        lambda x: raggedfn.argmax(x, 1),
        lambda x: raggedfn.argmin(x, 2),
        lambda x: raggedfn.sort(x, 1),
        lambda x: raggedfn.argsort(x, 2),
        lambda x: raggedfn.topk(x, 1, 1),
        lambda x: x < 0,
        lambda x: raggedfn.ge(0, x),
    ],
)
def test_ordered_ops_refuse_complex_values(call):
    x = raggedfn.from_lengths(torch.randn(5, 2, dtype=torch.complex64), torch.tensor([2, 3]))
    with pytest.raises(
        RaggedError,
        match=r"expected a real dtype \(complex numbers have no order\), got values of torch.complex64",
    ):
        call(x)


def test_comparison_with_a_complex_number_is_refused():
    with pytest.raises(RaggedError, match=r"lt: expected a real operand .* got 1j"):
        raggedfn.lt(tokens(), 1j)


def test_from_sizes_requires_b_by_r():
    with pytest.raises(
        RaggedError,
        match=r"from_sizes: expected sizes of shape \[B, R\], got a torch.int64 tensor of shape "
        r"\(2,\) on cpu; for one ragged axis pass lengths.unsqueeze\(1\) or use from_lengths",
    ):
        raggedfn.from_sizes(torch.zeros(5), torch.tensor([2, 3]))


def test_from_list_of_lists_gives_nested_levels():
    x = raggedfn.from_list([[torch.zeros(2), torch.zeros(3)], [torch.zeros(1)]])
    assert x.shape == (2, None, None) and x.sizes.tolist() == [[2, 5], [1, 1]]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([[1, 2, 3], [4]], r"from_list: expected tensors or lists of tensors, got int 1"),
        (
            [torch.zeros(2), (torch.zeros(1),)],
            r"from_list: sample 1 must be a tensor, got tuple .*samples mix tensors and lists",
        ),
        (
            [[torch.zeros(2)], torch.zeros(1)],
            r"from_list: sample 1 must be a list \(of tensors or lists\), got .*depth 2",
        ),
    ],
)
def test_from_list_of_mixed_lists_names_the_entry(tensors, message):
    with pytest.raises(RaggedError, match=message):
        raggedfn.from_list(tensors)


def test_gather_out_of_range_names_the_sample_and_the_value():
    x = tokens((3, 4), dim=2)
    index = raggedfn.from_lengths(torch.tensor([[0, 1], [2, 0], [0, 3], [4, 1]]), [1, 3])
    with pytest.raises(
        RaggedError,
        match=r"gather: expected index values in \[0, 4\) along axis 1 of sample 1, got 4",
    ):
        raggedfn.gather(x, 1, index)
    rows = torch.zeros(7, 2, dtype=I64)
    rows[5, 1] = -1  # sample 1 holds rows 3..6
    negative = raggedfn.from_lengths(rows, [3, 4])
    with pytest.raises(
        RaggedError,
        match=r"take_along_dim: expected index values in \[0, 2\) along axis 2 of sample 1, got -1",
    ):
        raggedfn.take_along_dim(x, negative, 2)


def test_layout_errors_are_ragged_errors():
    with pytest.raises(
        RaggedError, match=r"Layout: expected a layout code string or a tuple of Axis, got int 5"
    ):
        Layout(5)  # type: ignore[arg-type]
    with pytest.raises(RaggedError, match=r"Layout: expected a code like 'r0 d0'"):
        Layout("r0 x1")


# ----- the -inf row policy: logsumexp and softmax follow torch ---------------------------

INF = float("inf")


def test_logsumexp_gradient_of_an_all_minus_inf_row_is_nan_as_torch():
    values = torch.tensor(
        [[-INF, 1.0], [-INF, 2.0], [0.5, -INF], [1.0, -INF]],
        dtype=torch.float64,
        requires_grad=True,
    )
    x = raggedfn.from_lengths(values, torch.tensor([2, 0, 2]))
    out = raggedfn.logsumexp(x, 1)
    (got,) = torch.autograd.grad(out[[0, 2]].sum(), values)
    samples = [values[0:2], values[2:4]]
    want_out = torch.stack([torch.logsumexp(s, 0) for s in samples])
    (want,) = torch.autograd.grad(want_out.sum(), values)
    torch.testing.assert_close(out[[0, 2]], want_out)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[0:2, 0].isnan().all() and got[0:2, 1].isfinite().all()
    # the gradient of logsumexp is softmax, and softmax of that row is NaN too
    soft = raggedfn.softmax(x.detach(), 1).values
    torch.testing.assert_close(soft, got, equal_nan=True)
    torch.testing.assert_close(soft[0:2], torch.softmax(values.detach()[0:2], 0), equal_nan=True)


def test_empty_sample_logsumexp_is_minus_inf_with_finite_derivatives():
    values = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    x = raggedfn.from_lengths(values, torch.tensor([2, 0, 3]))
    out = raggedfn.logsumexp(x, 1)
    assert out[1].eq(-INF).all()
    masked = torch.where(out.isfinite(), out, torch.zeros_like(out))
    (first,) = torch.autograd.grad(masked.pow(2).sum(), values, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), values)
    assert first.isfinite().all() and second.isfinite().all()


# ----- layering: the value does not import the op layer --------------------------------

VALUE_LAYER = ["_ragged.py", "_layout.py", "_errors.py", "_index.py", "_validate.py", "_axes.py"]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
            found.update("." * node.level + alias.name for alias in node.names if not node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("module", VALUE_LAYER)
def test_the_value_layer_imports_no_op_layer(module):
    imports = _imports(PACKAGE / module)
    above = {
        i for i in imports if i.lstrip(".").split(".")[0] in {"ops", "_map", "_prims", "_construct"}
    }
    assert not above, f"{module} imports {above}"
    assert not any(i.startswith("raggedfn") for i in imports)


def test_operators_are_bound_by_the_op_layer():
    assert Ragged.__add__.__module__ == "raggedfn.ops._operators"
    assert (tokens() + 1).shape == (3, None, 3)
