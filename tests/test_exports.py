"""The public names: ``raggedfn.ops`` re-exports every op submodule's ``__all__``."""

import importlib
import pkgutil

import raggedfn
import raggedfn.ops


def test_ops_reexports_every_submodule_all() -> None:
    expected: set[str] = set()  # a name may be listed twice (_select re-exports _pairs)
    for info in pkgutil.iter_modules(raggedfn.ops.__path__):
        module = importlib.import_module(f"raggedfn.ops.{info.name}")
        expected.update(getattr(module, "__all__", []))
    assert set(raggedfn.ops.__all__) == expected
    assert len(set(raggedfn.ops.__all__)) == len(raggedfn.ops.__all__)
    for name in raggedfn.ops.__all__:
        assert getattr(raggedfn.ops, name) is getattr(raggedfn, name)
        assert name in raggedfn.__all__
