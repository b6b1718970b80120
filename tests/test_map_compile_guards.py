"""The guards dynamo installs for ``raggedfn.map`` inside ``torch.compile``: those on
what ``f`` reads (module state, captured numbers, hooks as dynamo's own config says),
none on map's own cache, plans and check constants."""

from __future__ import annotations

import re
import types

import pytest
import torch

import raggedfn
from tests.test_map import tokens

LAYOUT = raggedfn.Layout.standard(1, 1)

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, t):
        return (self.linear(t) * self.scale).tanh()


def _batch(seed: int = 0):
    x = tokens([3, 5, 2], dim=8, dtype=torch.float32, seed=seed)
    return x.values, x.offsets, x.sizes


def _compiled(model):
    def step(values, offsets, sizes):
        x = raggedfn.Ragged(values, offsets, sizes, LAYOUT)
        return raggedfn.map(model, x).values

    torch._dynamo.reset()
    return step, torch.compile(step, fullgraph=True, dynamic=True, backend="eager")


def _sources(fn) -> list[str]:
    """The source of every leaf guard of the frame's cache entries."""
    out = []
    for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__):
        stack = [entry.guard_manager.root]
        while stack:
            node = stack.pop()
            out.extend(node.get_source() for _ in node.get_leaf_guards())
            stack.extend(node.get_child_managers())
    return out


def test_no_guard_on_maps_cache_plans_or_check_constants():
    model = Scaled()
    step, compiled = _compiled(model)
    b = _batch()
    torch.testing.assert_close(compiled(*b), step(*b))
    sources = _sources(step)
    # the check's constants (types, code objects) sit in its closure, not its globals
    constants = re.compile(r"___unnamed_scope_\d+_c\d+'\]\['K\d+'\]")
    assert not [s for s in sources if constants.search(s)]
    # the registry's attribute for the variant (the live lookup), nothing read from it
    registry = [s for s in sources if "REGISTRY" in s]
    lookup = re.compile(r".*\.REGISTRY(\.v\d+(\.__code__)?)?")
    assert registry and all(lookup.fullmatch(s) for s in registry), registry
    # what f reads stays guarded: the module's state and its class
    assert any("'scale'" in s for s in sources)
    assert any("'training'" in s for s in sources)


def test_module_state_still_recompiles_and_the_graph_follows_it():
    model = Scaled()
    step, compiled = _compiled(model)
    b = _batch()
    torch.testing.assert_close(compiled(*b), step(*b))
    model.scale = -1.0
    torch.testing.assert_close(compiled(*b), step(*b))
    with torch.no_grad():
        model.linear.weight = torch.nn.Parameter(model.linear.weight * 3)  # rebound
    torch.testing.assert_close(compiled(*b), step(*b))


def _add_one(module, args, out):
    return out + 1


@pytest.mark.filterwarnings("ignore::raggedfn.RaggedPerformanceWarning")
def test_hooks_are_guarded_when_dynamo_guards_module_hooks():
    # with dynamo's own hook guards on, a hook registered after compiling recompiles:
    # the check keeps the hook dictionaries' lines, and map (which runs a module with
    # hooks per sample) says so inside the graph
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        model = Scaled()
        step, compiled = _compiled(model)
        b = _batch()
        torch.testing.assert_close(compiled(*b), step(*b))
        handle = model.linear.register_forward_hook(_add_one)
        try:
            with pytest.raises(Exception, match="forward_hooks"):
                compiled(*b)
        finally:
            handle.remove()


@pytest.mark.filterwarnings("ignore::raggedfn.RaggedPerformanceWarning")
def test_eager_map_always_sees_a_new_hook():
    model = Scaled()
    x = tokens([3, 5, 2], dim=8, dtype=torch.float32, seed=0)
    before = raggedfn.map(model, x).values
    handle = model.linear.register_forward_hook(_add_one)
    try:
        after = raggedfn.map(model, x).values
        loop = torch.cat(
            [model(x.values[o : o + n]) for o, n in zip(x.offsets[:-1], x.sizes, strict=True)]
        )
        torch.testing.assert_close(after, loop)
        assert not torch.allclose(after, before)
    finally:
        handle.remove()


def test_singletons_are_compared_by_identity():
    # False, 0 and None are equal or falsy but different states: each its own trace
    cfg = types.SimpleNamespace(flag=False)

    def f(t):
        if cfg.flag is False:
            return t * 2
        if cfg.flag is None:
            return t * 5
        return t * 3

    x = tokens([3, 2], dim=4, dtype=torch.float32, seed=1)
    for flag, factor in ((False, 2), (0, 3), (None, 5), (False, 2), (0, 3)):
        cfg.flag = flag
        torch.testing.assert_close(raggedfn.map(f, x).values, x.values * factor)


def _kinds(fn) -> list[tuple[str, str]]:
    """``(source, guard kind)`` of every leaf guard of the frame's cache entries."""
    out = []
    for entry in torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__):
        stack = [entry.guard_manager.root]
        while stack:
            node = stack.pop()
            out.extend((node.get_source(), type(g).__name__) for g in node.get_leaf_guards())
            stack.extend(node.get_child_managers())
    return out


def test_numbers_and_module_dicts_get_one_guard_each():
    # an int attribute: its value guard alone (dynamo's EQUALS_MATCH compares the type
    # too); a module's parameter, buffer and submodule dicts: their length alone (the
    # entries' lookups guard the keys)
    model = Scaled()
    step, compiled = _compiled(model)
    b = _batch()
    torch.testing.assert_close(compiled(*b), step(*b))
    kinds = _kinds(step)
    width = [k for s, k in kinds if s.endswith("['in_features']")]
    assert width == ["EQUALS_MATCH"], width
    scale = [k for s, k in kinds if s.endswith("['scale']")]
    assert scale == ["EQUALS_MATCH"], scale
    for table in ("_parameters", "_buffers", "_modules"):
        guards = sorted(k for s, k in kinds if s.endswith(f"linear']._{table[1:]}"))
        assert guards == ["DICT_LENGTH"], (table, guards)


class _Typed(torch.nn.Module):
    """Its forward tells 1, True and 1.0 apart, which compare equal."""

    def __init__(self, k) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.k = k

    def forward(self, t):
        factor = {bool: 2.0, int: 3.0, float: 5.0}[type(self.k)]
        return self.linear(t) * factor


@pytest.mark.parametrize("first, then", [(1, True), (True, 1), (1, 1.0), (1.0, 1)])
def test_a_number_of_another_type_but_an_equal_value_is_traced_again(first, then):
    model = _Typed(first)
    step, compiled = _compiled(model)
    b = _batch()
    torch.testing.assert_close(compiled(*b), step(*b))
    model.k = then
    torch.testing.assert_close(compiled(*b), step(*b))
    model.k = first
    torch.testing.assert_close(compiled(*b), step(*b))


class _Optional(torch.nn.Module):
    """Its forward reads an entry of its dicts only where one exists."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, t):
        out = self.linear(t)
        if hasattr(self, "shift"):
            out = out + self.shift
        if hasattr(self.linear, "gain"):
            out = out * self.linear.gain
        return out


def test_an_entry_added_renamed_or_removed_in_a_module_dict_is_seen():
    model = _Optional()
    step, compiled = _compiled(model)
    b = _batch()
    torch.testing.assert_close(compiled(*b), step(*b))
    model.register_buffer("shift", torch.full((8,), 3.0))  # a buffer: length 0 -> 1
    torch.testing.assert_close(compiled(*b), step(*b))
    model.linear.gain = torch.nn.Parameter(torch.full((8,), -2.0))  # a parameter
    torch.testing.assert_close(compiled(*b), step(*b))
    # same length, another name
    del model.linear.gain
    model.linear.register_parameter("other", torch.nn.Parameter(torch.ones(8)))
    torch.testing.assert_close(compiled(*b), step(*b))
    del model.shift
    torch.testing.assert_close(compiled(*b), step(*b))
