"""The Ragged value: attributes, new values, indexing, repr and structural checks."""

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import raggedfn
from raggedfn import Layout, Ragged, RaggedError


def tokens(lengths=(2, 0, 3), dim=4, dtype=torch.float64):
    total = sum(lengths)
    values = torch.arange(total * dim, dtype=dtype).reshape(total, dim)
    return raggedfn.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))


def pairs():
    return raggedfn.from_list(
        [torch.arange(n * n * 2.0).reshape(n, n, 2) + 100 * n for n in (2, 3)], ragged_dims=(1, 2)
    )


def images():
    # [C, H*, W*] with the channel axis dense and stored last
    return raggedfn.from_list(
        [torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(3, 5, 1, dtype=torch.float64)],
        ragged_dims=(2, 3),
    )


# ----- attributes ------------------------------------------------------------------


def test_token_attributes():
    x = tokens()
    assert x.batch_size == 3 and len(x) == 3
    assert x.shape == (3, None, 4)
    assert x.ndim == 3 and x.dim() == 3
    assert x.ragged_dims == (1,)
    assert x.num_ragged == 1
    assert x.dtype == torch.float64
    assert x.device == torch.device("cpu")
    assert x.layout == Layout.standard(1, 1)
    assert x.offsets.tolist() == [0, 2, 2, 5]
    assert x.sizes.tolist() == [[2], [0], [3]]
    assert x.lengths.tolist() == [2, 0, 3]
    assert x.values.shape == (5, 4)
    assert not x.requires_grad


def test_pair_attributes():
    x = pairs()
    assert x.shape == (2, None, None, 2)
    assert x.ragged_dims == (1, 2)
    assert x.sizes.tolist() == [[2, 2], [3, 3]]
    assert x.offsets.tolist() == [0, 4, 13]
    assert x.ndim == 4


def test_image_attributes_keep_the_channel_axis_dense():
    x = images()
    assert x.shape == (2, 3, None, None)
    assert x.ragged_dims == (2, 3)
    assert x.sizes.tolist() == [[2, 4], [5, 1]]
    assert x.values.shape == (13, 3)


def test_lengths_needs_one_ragged_axis():
    with pytest.raises(
        RaggedError,
        match=r"lengths: a value with 2 ragged axes has no single length per sample; use sizes",
    ):
        _ = pairs().lengths


def test_ragged_is_frozen():
    x = tokens()
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.values = torch.zeros(5, 4)  # type: ignore[misc]


def test_truth_value_is_refused():
    with pytest.raises(
        RaggedError, match=r"Ragged.__bool__: the truth value of a Ragged value is ambiguous"
    ):
        bool(tokens())


# ----- new values ------------------------------------------------------------------


def test_with_values_keeps_partitions():
    x = tokens()
    y = x.with_values(x.values * 2)
    assert y.offsets is x.offsets and y.sizes is x.sizes and y.layout == x.layout
    assert torch.equal(y.values, x.values * 2)
    # a new dense shape is allowed for the standard layout
    z = x.with_values(torch.zeros(5, 2, 7))
    assert z.shape == (3, None, 2, 7)


def test_with_values_errors():
    x = tokens()
    with pytest.raises(
        RaggedError, match=r"with_values: values must have 5 packed rows, got shape \(4, 4\)"
    ):
        x.with_values(torch.zeros(4, 4))
    with pytest.raises(RaggedError, match=r"with_values: values must be a tensor, got list"):
        x.with_values([1.0])  # type: ignore[arg-type]
    with pytest.raises(
        RaggedError, match=r"with_values: values of shape \(13, 3, 2\) change the dense axes"
    ):
        images().with_values(torch.zeros(13, 3, 2))
    for shape in ((5, 4), (5, 2, 7)):  # same and new dense axes: values on another device
        with pytest.raises(RaggedError, match=r"on one device, got meta, cpu and cpu"):
            x.with_values(torch.zeros(shape, device="meta"))


def test_to_detach_and_dtype_helpers():
    x = tokens().with_values(tokens().values.requires_grad_(True))
    assert x.requires_grad
    d = x.detach()
    assert not d.requires_grad and d.offsets is x.offsets
    f = x.to(torch.float32)
    assert f.dtype == torch.float32 and f.offsets.dtype == torch.int64
    assert x.float().dtype == torch.float32 and x.float().double().dtype == torch.float64
    assert x.cpu().device == torch.device("cpu")
    m = x.detach().to("meta")
    assert m.device == torch.device("meta")
    assert m.offsets.device == m.sizes.device == torch.device("meta")


def test_no_method_mutates_its_input():
    x = tokens()
    version = x.values._version
    x.with_values(x.values + 1)
    x.to(torch.float32)
    x.detach()
    x[0]
    x[1:]
    x[torch.tensor([2, 0])]
    repr(x)
    assert x.values._version == version
    assert x.offsets.tolist() == [0, 2, 2, 5]


# ----- indexing ---------------------------------------------------------------------


def test_sample_index_returns_logical_tensors():
    x = tokens()
    assert torch.equal(x[0], x.values[0:2])
    assert x[1].shape == (0, 4)
    assert torch.equal(x[-1], x.values[2:5])
    assert torch.equal(x[torch.tensor(2)], x.values[2:5])
    assert torch.equal(x[np.int64(0)], x.values[0:2])
    p = pairs()
    assert torch.equal(p[1], torch.arange(18.0).reshape(3, 3, 2) + 300)
    img = images()
    assert img[0].shape == (3, 2, 4) and img[1].shape == (3, 5, 1)
    # the image sample comes back in logical [C, H, W] order
    assert torch.equal(img[1].permute(1, 2, 0).reshape(-1, 3), img.values[8:13])


def test_sub_batches():
    x = tokens()
    for sub, picked in [
        (x[1:], [1, 2]),
        (x[::-1], [2, 1, 0]),
        (x[::2], [0, 2]),
        (x[torch.tensor([2, 0, 2])], [2, 0, 2]),
        (x[torch.tensor([-1])], [2]),
        (x[torch.tensor([True, False, True])], [0, 2]),
        (x[[True, False, True]], [0, 2]),
        (x[[1, 0]], [1, 0]),
        (x[[]], []),
        (x[5:], []),
    ]:
        assert isinstance(sub, Ragged)
        raggedfn.check(sub)
        assert sub.batch_size == len(picked)
        for i, j in enumerate(picked):
            assert torch.equal(sub[i], x[j])
    p = pairs()[[1]]
    assert p.sizes.tolist() == [[3, 3]] and torch.equal(p[0], pairs()[1])


def test_iteration_yields_samples():
    x = tokens()
    assert [s.shape[0] for s in x] == [2, 0, 3]


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (3, r"Ragged.__getitem__: sample 3 is out of range for a batch of 3"),
        (-4, r"Ragged.__getitem__: sample -4 is out of range for a batch of 3"),
        (torch.tensor(7), r"Ragged.__getitem__: sample 7 is out of range for a batch of 3"),
        (
            [0, 5],
            r"Ragged.__getitem__: sample indices \[0, 5\] are out of range for a batch of 3",
        ),
        (
            torch.tensor([-4]),
            r"Ragged.__getitem__: sample indices \[-4\] are out of range for a batch of 3",
        ),
        (
            torch.tensor([[0]]),
            r"Ragged.__getitem__: a sample index tensor must be 1-D, got a torch.int64 tensor of shape \(1, 1\)",
        ),
        (
            torch.tensor([True]),
            r"Ragged.__getitem__: a boolean sample mask must have 3 entries, got a torch.bool tensor of shape \(1,\)",
        ),
        (
            torch.tensor([0.0]),
            r"Ragged.__getitem__: a sample index tensor must be int or bool, got a torch.float32 tensor",
        ),
        (
            (0, 1),
            r"Ragged.__getitem__: multi-axis indexing \(0, 1\) is not supported; index a sample first",
        ),
        ([True, 1], r"Ragged.__getitem__: a list index must hold only ints or only bools"),
        ([0.5], r"Ragged.__getitem__: a list index must hold only ints or only bools"),
        (
            1.0,
            r"Ragged.__getitem__: index must be an int, a slice, a list or a 1-D int/bool tensor of samples, got float 1.0",
        ),
        (True, r"Ragged.__getitem__: index must be an int, .* got bool True"),
        (None, r"Ragged.__getitem__: index must be an int, .* got NoneType None"),
    ],
)
def test_bad_indices(index, message):
    with pytest.raises(RaggedError, match=message):
        tokens()[index]


def test_empty_batch_index():
    x = tokens(lengths=())
    assert x.batch_size == 0 and x[[]].batch_size == 0 and x[:].batch_size == 0
    with pytest.raises(RaggedError, match=r"sample 0 is out of range for a batch of 0"):
        x[0]


# ----- repr -------------------------------------------------------------------------


def test_repr():
    assert repr(tokens(dtype=torch.float32)) == (
        "Ragged(shape=(B=3, N*, 4), dtype=torch.float32, device=cpu, lengths=[2, 0, 3])"
    )
    assert repr(pairs()) == (
        "Ragged(shape=(B=2, N*, M*, 2), dtype=torch.float32, device=cpu, sizes=[[2, 2], [3, 3]])"
    )
    assert repr(images()).startswith("Ragged(shape=(B=2, 3, N*, M*), dtype=torch.float64")
    assert repr(tokens(lengths=(1, 2, 3, 4, 5, 6))).endswith("lengths=[1, 2, 3, 4, ...])")
    assert repr(tokens(lengths=())).endswith("lengths=[])")
    assert repr(raggedfn.from_lengths(torch.zeros(3), [3])) == (
        "Ragged(shape=(B=1, N*,), dtype=torch.float32, device=cpu, lengths=[3])"
    )


# ----- structural checks of the dataclass constructor ------------------------------


def _parts():
    return (
        torch.zeros(5, 4),
        torch.tensor([0, 2, 5]),
        torch.tensor([[2], [3]]),
        Layout.standard(1, 1),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layout": "N*"}, r"Ragged: expected layout to be a Layout, got str 'N\*'"),
        ({"values": [1.0]}, r"Ragged: expected values to be a tensor, got list"),
        ({"offsets": (0, 5)}, r"Ragged: expected offsets to be a tensor, got tuple"),
        (
            {"offsets": torch.tensor([0.0, 2.0, 5.0])},
            r"Ragged: expected offsets to be an int64 \[B \+ 1\] tensor, got a torch.float32 tensor of shape \(3,\)",
        ),
        (
            {"offsets": torch.tensor([[0, 2, 5]])},
            r"Ragged: expected offsets to be an int64 \[B \+ 1\] tensor, got a torch.int64 tensor of shape \(1, 3\)",
        ),
        (
            {"offsets": torch.tensor([0, 2, 5], dtype=torch.int32)},
            r"Ragged: expected offsets to be an int64 \[B \+ 1\] tensor, got a torch.int32",
        ),
        (
            {"sizes": torch.tensor([2, 3])},
            r"Ragged: expected sizes to be an int64 \[B, R\] tensor, got a torch.int64 tensor of shape \(2,\)",
        ),
        (
            {"values": torch.tensor(1.0), "layout": Layout.standard(1, 0)},
            r"Ragged: expected values with a packed leading axis \[T, ...\], got a torch.float32 tensor of shape \(\)",
        ),
        (
            {"values": torch.zeros(5)},
            r"Ragged: expected values with 1 dense axes as the layout 'r0 d0' declares, got values of shape \(5,\)",
        ),
        (
            {"sizes": torch.tensor([[2, 1], [3, 1]])},
            r"Ragged: expected sizes with 1 columns \(one per ragged axis of the layout 'r0 d0'\), got sizes of shape \(2, 2\)",
        ),
        (
            {"sizes": torch.tensor([[2], [3], [0]])},
            r"Ragged: expected sizes of shape \[B, R\] with B = len\(offsets\) - 1 = 2, got sizes of shape \(3, 1\)",
        ),
        (
            {"offsets": torch.tensor([0, 2, 5], device="meta")},
            r"Ragged: expected values, offsets and sizes on one device, got cpu, meta and cpu",
        ),
    ],
)
def test_structural_errors(change, message):
    values, offsets, sizes, layout = _parts()
    parts = {"values": values, "offsets": offsets, "sizes": sizes, "layout": layout, **change}
    with pytest.raises(RaggedError, match=message):
        Ragged(**parts)


def test_ragged_error_is_a_value_error():
    assert issubclass(RaggedError, ValueError)


def test_unchecked_malformed_values_raise_and_never_crash():
    # The dataclass constructor skips value checks (hot paths); ops on such a value
    # must still raise, not corrupt memory (torch's repeat_interleave with
    # output_size aborts the process on negative repeats or a short total). A
    # subprocess keeps a regression from killing the test run.
    code = textwrap.dedent(
        """
        import torch, raggedfn
        from raggedfn import Layout, Ragged
        cases = [([0, 3, 7], 9), ([0, -1, 3], 3), ([0, 3, 7], 5), ([2, 3], 3), ([0, 5, 2], 9)]
        for offsets, total in cases:
            sizes = torch.ones(len(offsets) - 1, 1, dtype=torch.int64)
            x = Ragged(torch.randn(total, 2), torch.tensor(offsets), sizes, Layout.standard(1, 1))
            for f in (raggedfn.to_padded, lambda x: raggedfn.sum(x, dim=1), raggedfn.mask):
                try:
                    f(x)  # garbage in: an error or garbage out, but the process survives
                except (RuntimeError, IndexError, ValueError):
                    pass
            try:
                raggedfn.check(x)
            except raggedfn.RaggedError:
                pass
            else:
                raise SystemExit(f"check passed offsets {offsets}, T = {total}")
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("offsets", "total", "expected"),
    [
        ([0, 2, 2, 5], 5, [0, 0, 2, 2, 2]),  # valid: sample 1 is empty
        ([0], 0, []),
        # malformed: repeat_interleave(output_size=T) would corrupt the heap on these
        ([0, 3, 7], 9, [0, 0, 0, 1, 1, 1, 1, 2, 2]),  # rows past offsets[-1] get id B
        ([0, -1, 3], 3, [1, 1, 1]),  # a negative length counts as 0
        ([0, 3, 7], 5, [0, 0, 0, 1, 1]),  # lengths past T are cut at T
        ([0, 10**12], 4, [0, 0, 0, 0]),
    ],
)
def test_segment_ids_are_safe_on_malformed_offsets(offsets, total, expected):
    from raggedfn._index import segment_ids

    assert segment_ids(torch.tensor(offsets), total).tolist() == expected
