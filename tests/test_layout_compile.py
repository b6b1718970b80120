"""Layout reads inside compiled code stay constants (torch 2.13, dynamic=True).

Dynamo turns int attributes of an input into symbols under ``dynamic=True``, and
``Axis(True, 1) == layout.axes[2]`` then silently compared False. ``Layout``
stores a string for that reason; this test fails if that ever regresses.
"""

import torch

import raggedfn
from raggedfn import Axis


def _probe(x):
    axes = x.layout.axes
    return (
        x.values * axes[2].index,
        Axis(True, 1) == axes[2],
        Axis(True, 1) in axes,
        axes.index(Axis(False, 1)),
        x.layout.num_dense,
    )


def test_layout_axes_are_constants_under_dynamic_compile():
    x = raggedfn.from_list([torch.randn(3, 2, 2, 4), torch.randn(3, 3, 3, 4)], ragged_dims=(2, 3))
    torch._dynamo.reset()
    got = torch.compile(_probe, fullgraph=True, dynamic=True, backend="eager")(x)
    want = _probe(x)
    torch.testing.assert_close(got[0], want[0])
    assert got[1:] == want[1:] == (True, True, 3, 2)
