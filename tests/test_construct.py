"""Constructors, conversions and validation of user data (issue #2 sections 3 and 4)."""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import raggedfn
from raggedfn import Layout, Ragged, RaggedError

I64 = torch.int64


def lengths(*values):
    return torch.tensor(values, dtype=I64)


# ----- from_list ----------------------------------------------------------------------


def test_from_list_tokens():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    x = raggedfn.from_list([a, b])
    assert x.shape == (2, None, 3) and x.layout == Layout.standard(1, 1)
    assert torch.equal(x.values, torch.cat([a, b]))
    assert x.offsets.tolist() == [0, 2, 6] and x.sizes.tolist() == [[2], [4]]
    assert x.values.data_ptr() != a.data_ptr()


def test_from_list_single_sample_copies():
    a = torch.randn(2, 3)
    x = raggedfn.from_list((a,))
    assert torch.equal(x.values, a) and x.values.data_ptr() != a.data_ptr()


def test_from_list_pairs_and_images():
    p = [torch.randn(n, n, 2) for n in (2, 0, 3)]
    x = raggedfn.from_list(p, ragged_dims=(1, 2))
    assert x.sizes.tolist() == [[2, 2], [0, 0], [3, 3]]
    assert torch.equal(x.values, torch.cat([t.reshape(-1, 2) for t in p]))
    imgs = [torch.randn(3, 2, 4), torch.randn(3, 5, 1)]
    y = raggedfn.from_list(imgs, ragged_dims=(2, 3))
    assert y.shape == (2, 3, None, None)
    # stored with the channel axis last: [H*W, C] per sample
    assert torch.equal(y.values, torch.cat([t.permute(1, 2, 0).reshape(-1, 3) for t in imgs]))
    # negative ragged_dims count from the end like torch
    z = raggedfn.from_list(imgs, ragged_dims=(-2, -1))
    assert z.layout == y.layout and torch.equal(z.values, y.values)
    # a single int is one axis
    assert raggedfn.from_list([torch.zeros(2, 3)], ragged_dims=2).shape == (1, 2, None)


def test_from_list_keeps_gradients():
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 3, requires_grad=True)
    raggedfn.from_list([a, b]).values.sum().backward()
    assert torch.equal(a.grad, torch.ones(2, 3)) and torch.equal(b.grad, torch.ones(1, 3))


def test_ragged_axes_are_declared_not_guessed():
    equal = raggedfn.from_list([torch.zeros(3, 2), torch.zeros(3, 2)])
    assert equal.shape == (2, None, 2)
    dense_only = raggedfn.from_list([torch.zeros(3, 2), torch.zeros(4, 2)], ragged_dims=(1,))
    assert dense_only.ragged_dims == (1,)


@pytest.mark.parametrize(
    ("tensors", "kwargs", "message"),
    [
        (
            [],
            {},
            r"from_list: tensors is an empty list, so the dtype and dense shape are unknown; use from_lengths",
        ),
        (
            torch.zeros(2, 3),
            {},
            r"from_list: tensors must be a list of tensors, got a torch.float32 tensor of shape \(2, 3\)",
        ),
        ([torch.zeros(2), [1.0]], {}, r"from_list: sample 1 must be a tensor, got list \[1.0\]"),
        (
            [torch.zeros(2, 3), torch.zeros(2, 4)],
            {},
            r"from_list: sample 1 has size 4 along axis 2, which is not ragged; expected 3 like sample 0 \(shapes \(2, 3\) and \(2, 4\)\)",
        ),
        (
            [torch.zeros(2, 2, 3), torch.zeros(3, 3, 3), torch.zeros(4, 4, 5)],
            {"ragged_dims": (1, 2)},
            r"from_list: sample 2 has size 5 along axis 3, which is not ragged; expected 3 like sample 0",
        ),
        (
            [torch.zeros(2, 3), torch.zeros(2)],
            {},
            r"from_list: sample 1 has rank 1 \(shape \(2,\)\), expected rank 2 like sample 0",
        ),
        (
            [torch.zeros(2), torch.zeros(2, dtype=torch.float64)],
            {},
            r"from_list: sample 1 has dtype torch.float64, expected torch.float32 like sample 0",
        ),
        (
            [torch.zeros(2), torch.zeros(2, device="meta")],
            {},
            r"from_list: sample 1 is on meta, expected cpu like sample 0",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (3,)},
            r"from_list: ragged_dims entry 3 is out of range for samples of rank 2 \(batched rank 3\)",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (-4,)},
            r"from_list: ragged_dims entry -4 is out of range for samples of rank 2",
        ),
        (
            [torch.tensor(1.0)],
            {},
            r"from_list: ragged_dims entry 1 is out of range for samples of rank 0",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (0,)},
            r"from_list: ragged_dims cannot include the batch axis 0",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (-3,)},
            r"from_list: ragged_dims cannot include the batch axis 0",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (1, -2)},
            r"from_list: ragged_dims \(1, -2\) repeat an axis",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": ()},
            r"from_list: ragged_dims must name at least one ragged axis",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": 1.5},
            r"from_list: ragged_dims must be a tuple of ints, got float 1.5",
        ),
        (
            [torch.zeros(2, 3)],
            {"ragged_dims": (1.0,)},
            r"from_list: ragged_dims entry 1.0 is out of range",
        ),
    ],
)
def test_from_list_errors(tensors, kwargs, message):
    with pytest.raises(RaggedError, match=message):
        raggedfn.from_list(tensors, **kwargs)


# ----- from_lengths / from_offsets / from_sizes ---------------------------------------


def test_from_lengths_and_offsets_agree():
    values = torch.randn(6, 2)
    a = raggedfn.from_lengths(values, lengths(2, 0, 4))
    b = raggedfn.from_offsets(values, torch.tensor([0, 2, 2, 6]))
    c = raggedfn.from_lengths(values, [2, 0, 4])
    d = raggedfn.from_offsets(values, torch.tensor([0, 2, 2, 6], dtype=torch.int32))
    for x in (a, b, c, d):
        assert x.values is values
        assert x.offsets.dtype == I64 and x.sizes.dtype == I64
        assert x.offsets.tolist() == [0, 2, 2, 6] and x.sizes.tolist() == [[2], [0], [4]]
        assert x.layout == Layout.standard(1, 1)


def test_empty_batches():
    x = raggedfn.from_lengths(torch.zeros(0, 3), torch.zeros(0, dtype=I64))
    y = raggedfn.from_offsets(torch.zeros(0, 3), [0])
    z = raggedfn.from_lengths(torch.zeros(0, 3), [])
    for v in (x, y, z):
        assert v.batch_size == 0 and v.shape == (0, None, 3)
        assert raggedfn.to_padded(v).shape == (0, 0, 3)
        assert raggedfn.mask(v).shape == (0, 0)
        assert raggedfn.unbind(v) == ()
    assert raggedfn.from_lengths(torch.zeros(0), [0, 0]).sizes.tolist() == [[0], [0]]


def test_from_sizes():
    values = torch.arange(13.0).unsqueeze(1).expand(13, 4)
    x = raggedfn.from_sizes(values, [[2, 2], [3, 3]])
    assert x.shape == (2, None, None, 4) and x.offsets.tolist() == [0, 4, 13]
    assert torch.equal(x[1][2, 1], values[4 + 2 * 3 + 1])
    # sizes are [B, R]: 1-D sizes are refused, never guessed to be [B, 1]
    with pytest.raises(RaggedError, match=r"from_sizes: expected sizes of shape \[B, R\]"):
        raggedfn.from_sizes(torch.zeros(5), [2, 3])
    # images: channel axis first, ragged axes second and third
    img = raggedfn.from_sizes(torch.arange(24.0).reshape(8, 3), [[2, 4]], ragged_dims=(2, 3))
    assert img.shape == (1, 3, None, None)
    assert torch.equal(img[0], torch.arange(24.0).reshape(2, 4, 3).permute(2, 0, 1))
    rect = raggedfn.from_sizes(torch.zeros(6, 3), [[2, 3]], ragged_dims=(1, 3))
    assert rect.shape == (1, None, 3, None) and rect[0].shape == (2, 3, 3)
    assert raggedfn.from_sizes(torch.zeros(0), [[0, 7], [5, 0]]).offsets.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # offsets
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), lengths(1, 2, 5)),
            r"from_offsets: offsets must start at 0, got offsets\[0\] = 1",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), lengths(0, 3, 2, 5)),
            r"from_offsets: offsets must never decrease, got offsets\[1\] = 3 > offsets\[2\] = 2",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), lengths(0, -1, 5)),
            r"from_offsets: offsets must never decrease, got offsets\[0\] = 0 > offsets\[1\] = -1",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), lengths(0, 2, 4)),
            r"from_offsets: offsets must end at values.shape\[0\] = 5, got offsets\[-1\] = 4",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), lengths(0, 3, 7)),
            r"from_offsets: offsets must end at values.shape\[0\] = 5, got offsets\[-1\] = 7",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), torch.tensor([[0, 5]])),
            r"from_offsets: offsets must be a 1-D \[B \+ 1\] tensor, got a torch.int64 tensor of shape \(1, 2\)",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), torch.zeros(0, dtype=I64)),
            r"from_offsets: offsets must be a 1-D \[B \+ 1\] tensor, got a torch.int64 tensor of shape \(0,\)",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), torch.tensor([0.0, 5.0])),
            r"from_offsets: offsets must have an integer dtype, got a torch.float32 tensor of shape \(2,\)",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), torch.tensor([False, True])),
            r"from_offsets: offsets must have an integer dtype, got a torch.bool tensor",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), [0.0, 5.0]),
            r"from_offsets: offsets must have an integer dtype, got a torch.float32 tensor",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), "0 5"),
            r"from_offsets: offsets must be an integer tensor, got str '0 5'",
        ),
        (
            lambda: raggedfn.from_offsets(torch.zeros(5), torch.tensor([0, 5], device="meta")),
            r"from_offsets: offsets must be on cpu like values, got a torch.int64 tensor of shape \(2,\) on meta",
        ),
        (
            lambda: raggedfn.from_offsets(torch.tensor(1.0), [0, 1]),
            r"from_offsets: values must have a packed leading axis \[T, ...\], got a torch.float32 tensor of shape \(\)",
        ),
        (
            lambda: raggedfn.from_offsets([1.0, 2.0], [0, 2]),
            r"from_offsets: values must be a tensor, got list",
        ),
        # lengths
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), lengths(6, -1)),
            r"from_lengths: lengths must be non-negative, got \[6, -1\]",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), lengths(2, 2)),
            r"from_lengths: lengths account for 4 packed rows in total but values.shape\[0\] = 5",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), lengths(3, 3)),
            r"from_lengths: lengths account for 6 packed rows in total but values.shape\[0\] = 5",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), torch.tensor([[5]])),
            r"from_lengths: lengths must be a 1-D \[B\] tensor, got a torch.int64 tensor of shape \(1, 1\)",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), torch.tensor([2.0, 3.0])),
            r"from_lengths: lengths must have an integer dtype, got a torch.float32 tensor of shape \(2,\)",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), torch.tensor([True, False])),
            r"from_lengths: lengths must have an integer dtype, got a torch.bool tensor",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), None),
            r"from_lengths: lengths must be an integer tensor, got NoneType None",
        ),
        (
            lambda: raggedfn.from_lengths(torch.zeros(5), torch.tensor([5], device="meta")),
            r"from_lengths: lengths must be on cpu like values, got a torch.int64 tensor of shape \(1,\) on meta",
        ),
        # sizes
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), [[-2, -2]]),
            r"from_sizes: sizes must be non-negative, got \[\[-2, -2\]\]",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(5), [[2, 2]]),
            r"from_sizes: sizes account for 4 packed rows in total but values.shape\[0\] = 5",
        ),
        (
            # int64 products would wrap to 0 and silently match an empty values tensor
            lambda: raggedfn.from_sizes(torch.zeros(0), [[2**32, 2**32]]),
            r"from_sizes: sample 0 has sizes \[4294967296, 4294967296\] whose product exceeds the 0 packed rows of values",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), [[2.0, 2.0]]),
            r"from_sizes: sizes must have an integer dtype, got a torch.float32 tensor of shape \(1, 2\)",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), torch.zeros(1, 2, 2, dtype=I64)),
            r"from_sizes: sizes must be a \[B, R\] tensor with R >= 1, got a torch.int64 tensor of shape \(1, 2, 2\)",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), torch.zeros(2, 0, dtype=I64)),
            r"from_sizes: sizes must be a \[B, R\] tensor with R >= 1, got a torch.int64 tensor of shape \(2, 0\)",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), [[2, 2]], ragged_dims=(0, 1)),
            r"from_sizes: ragged_dims cannot include the batch axis 0",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), [[2, 2]], ragged_dims=(1, 1)),
            r"from_sizes: ragged_dims \(1, 1\) repeat an axis",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), [[2, 2]], ragged_dims=(1, 5)),
            r"from_sizes: ragged_dims entry 5 is out of range for samples of rank 2 \(batched rank 3\)",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4, 3), [[2, 2]], ragged_dims=(1,)),
            r"from_sizes: ragged_dims \(1,\) name 1 axes but sizes has R = 2 columns",
        ),
        (
            lambda: raggedfn.from_sizes(torch.zeros(4), torch.tensor([[2, 2]], device="meta")),
            r"from_sizes: sizes must be on cpu like values",
        ),
    ],
)
def test_packed_constructor_errors(call, message):
    with pytest.raises(RaggedError, match=message):
        call()


# ----- check ---------------------------------------------------------------------------


def _unchecked(values, offsets, sizes):
    sizes = torch.tensor(sizes, dtype=I64)
    return Ragged(
        values,
        torch.tensor(offsets, dtype=I64),
        sizes,
        Layout.standard(sizes.shape[1], values.ndim - 1),
    )


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (
            ([0, 7], [[7]]),
            r"check: offsets must end at values.shape\[0\] = 5, got offsets\[-1\] = 7",
        ),
        (([1, 5], [[4]]), r"check: offsets must start at 0, got offsets\[0\] = 1"),
        (
            ([0, 4, 3, 5], [[4], [0], [2]]),
            r"check: offsets must never decrease, got offsets\[1\] = 4 > offsets\[2\] = 3",
        ),
        (
            ([0, 5], [[4]]),
            r"check: sample 0 has sizes \[4\] \(product 4\) but offsets give it 5 rows",
        ),
        (
            ([0, 1, 5], [[1, 1], [2, 3]]),
            r"check: sample 1 has sizes \[2, 3\] \(product 6\) but offsets give it 4 rows",
        ),
        (([0, 5], [[-5]]), r"check: sizes must be non-negative, got sizes\[0\] = \[-5\]"),
        (([0, 5], [[-1, -5]]), r"check: sizes must be non-negative, got sizes\[0\] = \[-1, -5\]"),
        (
            ([0, 5], [[2**32, 2**32]]),
            r"check: sample 0 has sizes \[4294967296, 4294967296\] \(product 18446744073709551616\) but offsets give it 5 rows",
        ),
        # the int64 product of these sizes wraps around to 0 rows: must still be caught
        (
            ([0, 0, 5], [[2**32, 2**32], [5, 1]]),
            r"check: sample 0 has sizes \[4294967296, 4294967296\] \(product 18446744073709551616\) but offsets give it 0 rows",
        ),
    ],
)
def test_check_finds_every_broken_invariant(parts, message):
    assert torch.tensor([[2**32, 2**32]]).prod(1).item() == 0  # why the wrap case matters
    x = _unchecked(torch.zeros(5), *parts)
    with pytest.raises(RaggedError, match=message):
        raggedfn.check(x)


def test_check_accepts_valid_values_and_refuses_non_ragged():
    x = raggedfn.from_lengths(torch.zeros(5), [0, 5, 0])
    assert raggedfn.check(x) is x
    with pytest.raises(
        RaggedError,
        match=r"check: x must be a Ragged value, got a torch.float32 tensor of shape \(5,\)",
    ):
        raggedfn.check(torch.zeros(5))


# ----- padded conversions and mask ------------------------------------------------------


def test_to_padded_and_back():
    x = raggedfn.from_list([torch.tensor([1.0]), torch.tensor([2.0, 3.0]), torch.zeros(0)])
    padded = raggedfn.to_padded(x, fill=-1.0)
    assert padded.tolist() == [[1.0, -1.0], [2.0, 3.0], [-1.0, -1.0]]
    wide = raggedfn.to_padded(x, shape=(3, 4))
    assert wide.tolist() == [[1.0, 0, 0, 0], [2.0, 3.0, 0, 0], [0, 0, 0, 0]]
    back = raggedfn.from_padded(padded, x.lengths)
    assert torch.equal(back.values, x.values) and torch.equal(back.offsets, x.offsets)
    assert raggedfn.from_padded(padded, [1, 2, 0]).lengths.tolist() == [1, 2, 0]


def test_to_padded_images_logical_order():
    imgs = [torch.randn(3, 2, 4), torch.randn(3, 5, 1)]
    x = raggedfn.from_list(imgs, ragged_dims=(2, 3))
    padded = raggedfn.to_padded(x, fill=float("nan"))
    assert padded.shape == (2, 3, 5, 4)
    assert torch.equal(padded[0, :, :2, :4], imgs[0]) and torch.equal(padded[1, :, :5, :1], imgs[1])
    assert padded[0, :, 2:].isnan().all() and padded[1, :, :, 1:].isnan().all()
    back = raggedfn.from_padded(padded, x.sizes, ragged_dims=(2, 3))
    assert back.layout == x.layout and torch.equal(back.values, x.values)
    assert raggedfn.to_padded(x, shape=(2, 3, 6, 7)).shape == (2, 3, 6, 7)
    m = raggedfn.mask(x)
    assert m.shape == (2, 5, 4)
    assert m[0].sum() == 8 and m[0, :2, :4].all() and m[1].sum() == 5 and m[1, :, 0].all()


def test_to_padded_int_and_bool_values():
    x = raggedfn.from_lengths(torch.arange(3), [1, 2])
    assert raggedfn.to_padded(x, fill=-1).tolist() == [[0, -1], [1, 2]]
    b = raggedfn.from_lengths(torch.tensor([True, True, False]), [1, 2])
    assert raggedfn.to_padded(b).tolist() == [[True, False], [True, False]]


def test_to_padded_is_differentiable():
    values = torch.randn(3, 2, requires_grad=True)
    x = raggedfn.from_lengths(values, [1, 2])
    (raggedfn.to_padded(x) * torch.arange(1.0, 5.0).reshape(1, 2, 2)).sum().backward()
    assert values.grad.tolist() == [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]


def test_mask():
    x = raggedfn.from_lengths(torch.zeros(3), [1, 0, 2])
    assert raggedfn.mask(x).tolist() == [[True, False], [False, False], [True, True]]
    p = raggedfn.from_list([torch.zeros(1, 2, 5), torch.zeros(3, 1, 5)], ragged_dims=(1, 2))
    assert raggedfn.mask(p).tolist() == [
        [[True, True], [False, False], [False, False]],
        [[True, False], [True, False], [True, False]],
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda x: raggedfn.to_padded(x, shape=(2, 2)),
            r"to_padded: shape \(2, 2\) has 2 along ragged axis 1 but a sample has 3 there",
        ),
        (
            lambda x: raggedfn.to_padded(x, shape=(2, 3, 1)),
            r"to_padded: shape \(2, 3, 1\) must have 2 entries \(logical shape \(2, None\)\)",
        ),
        (
            lambda x: raggedfn.to_padded(x, shape=(3, 3)),
            r"to_padded: shape \(3, 3\) must start with the batch size 2",
        ),
        (
            lambda x: raggedfn.to_padded(x.values),
            r"to_padded: x must be a Ragged value, got a torch.float32 tensor",
        ),
        (lambda x: raggedfn.mask(x.values), r"mask: x must be a Ragged value"),
        (lambda x: raggedfn.unbind(x.values), r"unbind: x must be a Ragged value"),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3), [1, 4]),
            r"from_padded: sizes along axis 1 reach 4 but padded has only 3 there \(shape \(2, 3\)\)",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3), [1, 2, 3]),
            r"from_padded: lengths_or_sizes must be \[B\] or \[B, R\] = \[2, 1\], got a torch.int64 tensor of shape \(3, 1\)",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3, 3), [1, 2], ragged_dims=(1, 2)),
            r"from_padded: lengths_or_sizes must be \[B\] or \[B, R\] = \[2, 2\], got a torch.int64 tensor of shape \(2, 1\)",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2), [1, 1]),
            r"from_padded: padded must be a \[B, ...\] tensor with at least one sample axis, got a torch.float32 tensor of shape \(2,\)",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3), [1, -1]),
            r"from_padded: lengths_or_sizes must be non-negative, got \[\[1\], \[-1\]\]",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3), [1.0, 2.0]),
            r"from_padded: lengths_or_sizes must have an integer dtype, got a torch.float32 tensor",
        ),
        (
            lambda x: raggedfn.from_padded(torch.zeros(2, 3), [1, 2], ragged_dims=(0,)),
            r"from_padded: ragged_dims cannot include the batch axis 0",
        ),
    ],
)
def test_padded_errors(call, message):
    x = raggedfn.from_lengths(torch.zeros(5), [2, 3])
    with pytest.raises(RaggedError, match=message):
        call(x)


# ----- unbind, nested, cu_seqlens --------------------------------------------------------


def test_unbind_views_values():
    values = torch.arange(13.0 * 2).reshape(13, 2)
    x = raggedfn.from_sizes(values, [[2, 2], [3, 3]])
    first, second = raggedfn.unbind(x)
    assert first.shape == (2, 2, 2) and second.shape == (3, 3, 2)
    assert torch.equal(second, values[4:].reshape(3, 3, 2))
    assert second.data_ptr() == values[4:].data_ptr()  # a view, no copy


def test_nested_round_trip_shares_storage():
    values = torch.randn(5, 3)
    x = raggedfn.from_lengths(values, [2, 0, 3])
    njt = raggedfn.to_nested(x)
    assert njt.is_nested and njt.layout == torch.jagged and njt.size(0) == 3
    # passed in, not computed later from the offsets (a host read; before _max_seqlen,
    # which computes and caches a missing value)
    assert njt._maybe_min_seqlen == 0 and njt._maybe_max_seqlen == 3
    assert njt._min_seqlen == 0 and njt._max_seqlen == 3
    assert njt.values().data_ptr() == values.data_ptr()
    back = raggedfn.from_nested(njt)
    assert back.values.data_ptr() == values.data_ptr()
    assert back.lengths.tolist() == [2, 0, 3]


def test_nested_errors():
    pairs = raggedfn.from_list([torch.zeros(2, 2)], ragged_dims=(1, 2))
    with pytest.raises(
        RaggedError,
        match=r"to_nested: needs one ragged axis at logical axis 1, got logical shape \(1, None, None\) \(ragged axes \(1, 2\)\)",
    ):
        raggedfn.to_nested(pairs)
    late = raggedfn.from_list([torch.zeros(3, 2)], ragged_dims=(2,))
    with pytest.raises(
        RaggedError,
        match=r"to_nested: needs one ragged axis at logical axis 1, got logical shape \(1, 3, None\)",
    ):
        raggedfn.to_nested(late)
    with pytest.raises(
        RaggedError, match=r"to_nested: torch.nested cannot hold an empty batch \(B = 0\)"
    ):
        raggedfn.to_nested(raggedfn.from_lengths(torch.zeros(0, 2), []))
    with pytest.raises(
        RaggedError,
        match=r"from_nested: njt must be a torch.nested tensor with layout=torch.jagged, got a torch.float32 tensor",
    ):
        raggedfn.from_nested(torch.zeros(2, 3))
    with pytest.raises(
        RaggedError,
        match=r"from_nested: njt must be a torch.nested tensor with layout=torch.jagged, got list",
    ):
        raggedfn.from_nested([1])
    with warnings.catch_warnings():  # torch warns (once per process) that strided NT is a prototype
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(
        RaggedError,
        match=r"from_nested: njt must be a torch.nested tensor with layout=torch.jagged, got a nested tensor with layout torch.strided",
    ):
        raggedfn.from_nested(strided)
    holes = torch.nested.nested_tensor_from_jagged(
        torch.zeros(6, 2), torch.tensor([0, 3, 6]), lengths=torch.tensor([2, 2])
    )
    with pytest.raises(RaggedError, match=r"from_nested: jagged tensors with holes"):
        raggedfn.from_nested(holes)


def test_cu_seqlens():
    offsets, max_len = raggedfn.cu_seqlens(raggedfn.from_lengths(torch.zeros(6, 2), [2, 0, 4]))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 2, 2, 6] and max_len == 4
    assert isinstance(max_len, int)
    empty = raggedfn.cu_seqlens(raggedfn.from_lengths(torch.zeros(0, 2), []))
    assert empty[0].tolist() == [0] and empty[1] == 0
    with pytest.raises(RaggedError, match=r"cu_seqlens: needs one ragged axis at logical axis 1"):
        raggedfn.cu_seqlens(raggedfn.from_list([torch.zeros(2, 2)], ragged_dims=(1, 2)))


@pytest.mark.parametrize(
    "lengths",
    [
        [2**63 - 1, 2**63 - 1, 7],  # the int64 sum wraps around to 5
        [-3, 8],  # adds up, but negative
        [2**53, 2**53, 5 - 2**54],  # float64 exact sum 5, but negative too
    ],
)
def test_from_lengths_refuses_lengths_that_only_add_up_by_wrapping_or_negatives(lengths):
    with pytest.raises(RaggedError, match="from_lengths"):
        raggedfn.from_lengths(torch.zeros(5), torch.tensor(lengths))


@pytest.mark.parametrize("host_check_max", [0, 10**6])  # the kernel check; the host check
@pytest.mark.parametrize(
    "lengths",
    [
        [2**63 - 1, 2**63 - 1, 7],  # the int64 sum wraps around to 5
        [-3, 8],  # adds up, but negative
        [2**53, 2**53, 5 - 2**54],  # float64 exact sum 5, but negative too
        [2, 2],  # short of the 5 rows
        [5, 0, -1, 1],  # a negative length in the middle
    ],
)
def test_from_lengths_both_checks_refuse_bad_lengths(lengths, host_check_max, monkeypatch):
    from raggedfn import _construct

    monkeypatch.setattr(_construct, "HOST_CHECK_MAX", host_check_max)
    with pytest.raises(RaggedError, match="from_lengths"):
        raggedfn.from_lengths(torch.zeros(5), torch.tensor(lengths))


@pytest.mark.parametrize("host_check_max", [0, 10**6])
@pytest.mark.parametrize("batch", [0, 1, 3, 40])
def test_from_lengths_both_checks_build_the_partition_of_the_lengths(
    batch, host_check_max, monkeypatch
):
    from raggedfn import _construct

    monkeypatch.setattr(_construct, "HOST_CHECK_MAX", host_check_max)
    gen = torch.Generator().manual_seed(batch)
    given = torch.randint(0, 4, (batch,), generator=gen, dtype=torch.int32)
    total = int(given.sum())
    values = torch.randn(total, 2)
    x = raggedfn.from_lengths(values, given)
    starts = [0]
    for n in given.tolist():  # reference: running sums in Python
        starts.append(starts[-1] + n)
    assert x.values is values and x.layout == Layout.standard(1, 1)
    assert x.offsets.dtype == I64 and x.sizes.dtype == I64 and x.sizes.shape == (batch, 1)
    assert x.offsets.tolist() == starts and x.sizes[:, 0].tolist() == given.tolist()
    given.fill_(7)  # the value owns its partition
    assert x.sizes[:, 0].tolist() != given.tolist() or batch == 0
    assert raggedfn.check(x) is x


@pytest.mark.parametrize("host_check_max", [0, 10**6])
def test_from_lengths_that_add_up_skip_the_partition_checks(host_check_max, monkeypatch):
    # non-negative lengths adding up to T (either check) build the value directly: the
    # per-check path (non_negative, check_total, validate_partition) is not taken
    from raggedfn import _construct

    monkeypatch.setattr(_construct, "HOST_CHECK_MAX", host_check_max)
    calls = []
    for name in ("non_negative", "check_total", "validate_partition"):
        monkeypatch.setattr(_construct, name, lambda *a, name=name: calls.append(name))
    values = torch.randn(6, 2)
    x = raggedfn.from_lengths(values, torch.tensor([2, 0, 4]))
    assert calls == []
    assert x.offsets.tolist() == [0, 2, 2, 6] and x.sizes[:, 0].tolist() == [2, 0, 4]
    raggedfn.from_lengths(torch.randn(5, 2), torch.tensor([2, 0, 4]))  # 6 != 5: the checks
    assert calls == ["non_negative", "check_total", "validate_partition"]


def test_from_list_of_lists_with_ragged_dims_keeps_each_sentences_pair_state():
    # documents of sentences, each sentence an (N, N, 4) pair state: both N axes ragged
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 2, 4, generator=gen), torch.randn(3, 3, 4, generator=gen)
    docs = [[p, q], [], [p]]
    x = raggedfn.from_list(docs, ragged_dims=(1, 2, 3))
    assert repr(x.layout) == "Layout('r0 n1 r2 d0')" and x.batch_size == 3
    for i, doc in enumerate(docs):
        sentences = raggedfn.unbind(x[i])
        assert len(sentences) == len(doc)
        for got, want in zip(sentences, doc, strict=True):
            assert torch.equal(got, want)


def test_from_list_of_ragged_samples_nests_them():
    gen = torch.Generator().manual_seed(1)
    first = [torch.randn(2, 4, generator=gen), torch.randn(3, 4, generator=gen)]
    second = [torch.randn(1, 4, generator=gen)]
    x = raggedfn.from_list([raggedfn.from_list(first), raggedfn.from_list(second)])
    assert x.shape == (2, None, None, 4) and x.sizes.tolist() == [[2, 5], [1, 1]]
    for i, doc in enumerate((first, second)):
        for got, want in zip(raggedfn.unbind(x[i]), doc, strict=True):
            assert torch.equal(got, want)


def _pair_samples():
    gen = torch.Generator().manual_seed(4)
    p, q, r = (torch.randn(n, n, 3, generator=gen) for n in (2, 3, 1))
    docs = ([p, q], [r])
    return docs, [raggedfn.from_list(doc, ragged_dims=(1, 2)) for doc in docs]


def test_from_list_of_ragged_pair_states_keeps_their_rectangles():
    # each sample's pair states are L x L rectangles: they stay rectangles, nested in
    # the new batch axis ('r2' after 'n1')
    docs, samples = _pair_samples()
    x = raggedfn.from_list(samples)
    assert repr(x.layout) == "Layout('r0 n1 r2 d0')" and x.batch_size == 2
    for i, doc in enumerate(docs):
        for got, want in zip(raggedfn.unbind(x[i]), doc, strict=True):
            assert torch.equal(got, want)


def test_from_list_of_ragged_samples_keeps_their_device_under_a_default_device():
    # a default-device context (torch.device("meta") here) does not move the partition
    # away from the samples' values
    docs, samples = _pair_samples()
    with torch.device("meta"):
        x = raggedfn.from_list(samples)
    assert x.values.device.type == x.offsets.device.type == x.sizes.device.type == "cpu"
    for i, doc in enumerate(docs):
        for got, want in zip(raggedfn.unbind(x[i]), doc, strict=True):
            assert torch.equal(got, want)


def test_from_list_of_a_nested_ragged_beside_lists_counts_its_nested_levels():
    # a Ragged of documents (sentences nested in them) first, beside a list of documents:
    # it stands for the lists of its samples, one list level per nested axis
    gen = torch.Generator().manual_seed(5)
    t = [torch.randn(n, 3, generator=gen) for n in (2, 1, 3, 2)]
    corpora = [[[t[0], t[1]], [t[2]]], [[t[3]]]]
    x = raggedfn.from_list([raggedfn.from_list(corpora[0]), corpora[1]])
    assert repr(x.layout) == "Layout('r0 n1 n2 d0')" and x.batch_size == 2
    for i, corpus in enumerate(corpora):
        assert x[i].batch_size == len(corpus)
        for j, doc in enumerate(corpus):
            for got, want in zip(raggedfn.unbind(x[i][j]), doc, strict=True):
                assert torch.equal(got, want)


@pytest.mark.parametrize(("ids", "bad"), [([0, 1, 3], 2), ([-1, 0, 0], 0)])
def test_from_segment_ids_names_the_first_id_outside_the_segments(ids, bad):
    with pytest.raises(
        RaggedError,
        match=rf"^from_segment_ids: segment_ids must lie in \[0, num_segments\) = \[0, 3\), "
        rf"got segment_ids\[{bad}\] = {ids[bad]}$",
    ):
        raggedfn.from_segment_ids(torch.zeros(3, 2), torch.tensor(ids), 3)


def test_from_list_of_a_ragged_sample_beside_lists_reads_it_as_its_samples():
    # a Ragged of pair states beside a list of pair states: the Ragged counts as the list
    # of its samples (one document of sentences each), whatever its number of ragged axes
    gen = torch.Generator().manual_seed(2)
    p, q, r = (torch.randn(n, n, 3, generator=gen) for n in (2, 3, 1))
    pairs = raggedfn.from_list([p, q], ragged_dims=(1, 2))
    x = raggedfn.from_list([pairs, [r]], ragged_dims=(1, 2, 3))
    assert repr(x.layout) == "Layout('r0 n1 r2 d0')" and x.batch_size == 2
    for i, doc in enumerate(([p, q], [r])):
        sentences = raggedfn.unbind(x[i])
        assert len(sentences) == len(doc)
        for got, want in zip(sentences, doc, strict=True):
            assert torch.equal(got, want)


def test_from_list_of_lists_with_rectangular_dims_checks_the_rectangles():
    # list level 2 rectangular with level 1: every sentence of a document has one length
    gen = torch.Generator().manual_seed(3)
    docs = [[torch.randn(2, 3, generator=gen), torch.randn(2, 3, generator=gen)], []]
    docs.append([torch.randn(1, 3, generator=gen)])
    x = raggedfn.from_list(docs, rectangular_dims=(2,))
    assert x.shape == (3, None, None, 3) and x.sizes.tolist() == [[2, 2], [0, 0], [1, 1]]
    for i, doc in enumerate(docs):
        got = x[i]
        assert got.shape == (len(doc), doc[0].shape[0] if doc else 0, 3)
        for j, sentence in enumerate(doc):
            assert torch.equal(got[j], sentence)
    docs[0][1] = torch.randn(1, 3, generator=gen)
    with pytest.raises(RaggedError, match=r"^from_list: .*rectangular with axis 0 .* sizes differ"):
        raggedfn.from_list(docs, rectangular_dims=(2,))


def _rectangles(values, outer, inner):
    return raggedfn.from_nested_lengths(values, [outer, inner], rectangular_dims=(2,)).values


def _from_sizes(values, sizes):
    return raggedfn.from_sizes(values, sizes).values


def _from_lengths(values, lengths):
    return raggedfn.from_lengths(values, lengths).values


_V7 = torch.arange(21.0).reshape(7, 3)
_T = torch.tensor


@pytest.mark.parametrize(
    ("build", "good", "bad", "message"),
    [
        (_from_lengths, (_V7, _T([3, 4])), (_V7, _T([3, 3])), "from_lengths: lengths must account"),
        (
            _from_sizes,
            (_V7, _T([[1, 3], [2, 2]])),
            (_V7, _T([[1, 3], [2, 1]])),
            "from_sizes: sizes must account for values.shape",
        ),
        (
            _rectangles,
            (_V7, _T([2, 1]), _T([2, 2, 3])),
            (_V7, _T([2, 1]), _T([2, 3, 2])),
            "from_nested_lengths: ragged axis 1 is rectangular with axis 0",
        ),
        (
            _rectangles,
            (_V7, _T([2, 0, 1]), _T([2, 2, 3])),
            (_V7, _T([3, -1]), _T([2, 2, 3])),
            r"from_nested_lengths: lengths\[0\] must be non-negative",
        ),
        (
            _rectangles,
            (_V7, _T([2, 1]), _T([2, 2, 3])),
            (_V7, _T([2, 1]), _T([2, 2, 2])),
            r"from_nested_lengths: lengths\[1\] must add up",
        ),
        (
            lambda values, ids: raggedfn.from_segment_ids(values, ids, 3).values,
            (_V7, _T([0, 0, 1, 1, 1, 2, 2])),
            (_V7, _T([0, 0, 1, 1, 1, 2, 5])),
            r"from_segment_ids: segment_ids must lie in \[0, num_segments\)",
        ),
    ],
    ids=["lengths", "sizes", "rectangles", "negative", "sum", "segment_ids"],
)
def test_constructors_traced_on_fake_tensors_check_the_data_in_the_graph(build, good, bad, message):
    # make_fx with fake tensors (as torch.compile and torch.export trace): the checks
    # cannot read the data, so they are asserts in the graph, refusing bad data at run time
    graph = make_fx(build, tracing_mode="fake")(*good)
    assert torch.equal(graph(*good), build(*good))
    with pytest.raises(RuntimeError, match=message):
        graph(*bad)
    with pytest.raises(RaggedError):
        build(*bad)  # and eagerly, with the RaggedError of the host check
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        # fake tensors outside any fx trace (shape propagation): no data to check
        fake = build(*(mode.from_tensor(t) for t in good))
    assert fake.shape == good[0].shape


# ----- survivors of the seed-1206 draw (2026-12-06): the errors name what is wrong ------


def test_from_list_names_the_sample_that_is_not_a_list():
    with pytest.raises(RaggedError, match=r"from_list: sample 1 must be a list \(of tensors"):
        raggedfn.from_list([[torch.zeros(2)], torch.zeros(1)])
    with pytest.raises(RaggedError, match=r"from_list: entry 1 at nesting depth 2 must be a list"):
        raggedfn.from_list([[[torch.zeros(2)], torch.zeros(1)]])


def test_from_list_names_a_non_tensor_leaf_at_any_depth():
    with pytest.raises(
        RaggedError, match=r"^from_list: expected tensors or lists of tensors, got int 1"
    ):
        raggedfn.from_list([[1, 2, 3], [4]])


def test_from_list_of_ragged_samples_names_the_sample_of_another_dtype():
    a = raggedfn.from_list([torch.zeros(2, 3), torch.zeros(1, 3)])
    b = raggedfn.from_list([torch.zeros(3, 3, dtype=torch.float64)])
    with pytest.raises(RaggedError, match=r"from_list: Ragged sample 1 "):
        raggedfn.from_list([a, b])


def test_from_list_names_the_innermost_tensor_empty_along_an_earlier_ragged_axis():
    docs = [[torch.zeros(2, 3, 4)], [torch.zeros(0, 3, 4), torch.zeros(1, 2, 4)]]
    with pytest.raises(
        RaggedError, match=r"from_list: tensor 1 of the innermost level has ragged sizes \[0, 3\]"
    ):
        raggedfn.from_list(docs, ragged_dims=(1, 2, 3))


def test_from_sizes_of_an_empty_batch() -> None:
    x = raggedfn.from_sizes(torch.zeros(0, 3), torch.zeros(0, 1, dtype=torch.int64))
    assert x.batch_size == 0 and x.values.shape == (0, 3)
    with pytest.raises(raggedfn.RaggedError, match="0 packed rows in total"):
        raggedfn.from_sizes(torch.zeros(2, 3), torch.zeros(0, 1, dtype=torch.int64))


def test_mask_stays_on_the_values_device_under_another_default_device() -> None:
    x = raggedfn.from_lengths(torch.zeros(4, 2), torch.tensor([1, 3, 0]))
    with torch.device("meta"):
        got = raggedfn.mask(x)
    assert got.device == x.values.device
    assert got.tolist() == [[True, False, False], [True, True, True], [False, False, False]]
