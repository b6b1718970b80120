"""The strategy reaches the cases every property test relies on."""

from hypothesis import given, settings
from hypothesis import strategies as st

import raggedfn
from property_tests.strategies import raggeds


@settings(deadline=None, max_examples=60)
@given(raggeds())
def test_drawn_values_are_valid(x):
    raggedfn.check(x)


def test_reaches_edge_cases():
    seen = set()

    @settings(deadline=None, max_examples=300, database=None)
    @given(raggeds(num_ragged=st.sampled_from([1, 2])))
    def probe(x):
        b = x.batch_size
        if b == 0:
            seen.add("B=0")
        if b == 1:
            seen.add("B=1")
        counts = (x.offsets[1:] - x.offsets[:-1]).tolist()
        if b and 0 in counts:
            seen.add("empty sample")
        if b > 1 and all((x.sizes == x.sizes[0]).all(1).tolist()):
            seen.add("equal sizes")

    probe()
    assert seen == {"B=0", "B=1", "empty sample", "equal sizes"}, seen


def test_extreme_values_reach_every_kind():
    """values=EXTREMES draws each extreme: +-1e3, -inf, all-equal, ties, subnormals."""
    import torch

    from property_tests.strategies import EXTREMES

    seen = set()

    @settings(deadline=None, max_examples=300, database=None)
    @given(raggeds(dtype=st.sampled_from([torch.float32, torch.float64]), values=EXTREMES))
    def probe(x):
        v = x.values
        finite = v[torch.isfinite(v)]
        if (v == float("-inf")).any():
            seen.add("-inf")
        if finite.numel() and finite.abs().max() >= 500:
            seen.add("+-1e3")
        if v.numel() > 1 and (v == v.reshape(-1)[0]).all():
            seen.add("all equal")
        if finite.numel() > len(set(finite.tolist())):
            seen.add("ties")
        tiny = torch.finfo(v.dtype).tiny
        if ((finite != 0) & (finite.abs() < tiny)).any():
            seen.add("subnormal")

    probe()
    assert seen == {"-inf", "+-1e3", "all equal", "ties", "subnormal"}, seen
