"""torch.export of modules that take ``Ragged`` values: raggedfn ops and ``raggedfn.map``.

Each program is exported once on an example batch with ``raggedfn.dynamic_shapes`` and
run on batches of other sizes and lengths; every output is compared with a per-sample
torch loop over the samples (the reference), and with the eager module. The map
modules are exported before any eager call of their ``f``: the trace is made while
export traces the module.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import raggedfn

D = 6
EXAMPLE = [3, 5, 4]
NEW = ([2, 7], [6, 2, 3, 9, 4], [5, 0, 2, 8])  # other batch sizes, lengths, an empty sample


def batch(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), D, generator=gen, dtype=torch.float64)
    return raggedfn.from_lengths(values, lengths)


def round_trip(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def export(module: torch.nn.Module, x: raggedfn.Ragged, name: str | None = None) -> list:
    """The exported program and its save/load round trip."""
    ep = torch.export.export(module, (x,), dynamic_shapes=(raggedfn.dynamic_shapes(x, name),))
    return [ep, round_trip(ep)]


def assert_ragged_equal(out: raggedfn.Ragged, samples: list[torch.Tensor]) -> None:
    assert isinstance(out, raggedfn.Ragged)
    got = raggedfn.unbind(out)
    assert len(got) == len(samples)
    for g, s in zip(got, samples, strict=True):
        torch.testing.assert_close(g, s)


class Pool(torch.nn.Module):
    """Linear, layer norm, softmax over the ragged axis, weighted sum: dense and ragged out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D, dtype=torch.float64)
        self.score = torch.nn.Linear(D, 1, dtype=torch.float64)

    def forward(self, x: raggedfn.Ragged) -> tuple[torch.Tensor, raggedfn.Ragged]:
        h = raggedfn.layer_norm(raggedfn.linear(x, self.proj.weight, self.proj.bias), D)
        w = raggedfn.softmax(raggedfn.linear(h, self.score.weight, self.score.bias), 1)
        return raggedfn.sum(w * h, 1), h

    def sample(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.layer_norm(self.proj(t), (D,))
        w = torch.softmax(self.score(h), 0)
        return (w * h).sum(0), h


@pytest.mark.parametrize("name", [None, "x"], ids=["auto", "named"])
def test_ops_module_runs_on_new_batch_sizes_and_lengths(name):
    torch.manual_seed(0)
    module = Pool()
    for ep in export(module, batch(EXAMPLE, 0), name):
        for seed, lengths in enumerate(NEW, 1):
            x = batch(lengths, seed)
            pooled, h = ep.module()(x)
            samples = [module.sample(t) for t in raggedfn.unbind(x)]
            torch.testing.assert_close(pooled, torch.stack([p for p, _ in samples]))
            assert_ragged_equal(h, [s for _, s in samples])
            eager_pooled, eager_h = module(x)
            torch.testing.assert_close(pooled, eager_pooled)
            torch.testing.assert_close(h.values, eager_h.values)


class Encoder(torch.nn.Module):
    """A transformer encoder layer per sample, mean-pooled: a dense ``[B, D]`` output."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(
            D, 2, 16, dropout=0.0, batch_first=True, dtype=torch.float64
        )

    def per_sample(self, t: torch.Tensor) -> torch.Tensor:
        return self.layer(t[None])[0].mean(0)

    def forward(self, x: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.map(self.per_sample, x)


class Attend(torch.nn.Module):
    """Attention, slicing and a reduction inside ``f``: a ragged and a dense output."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, dtype=torch.float64)

    def per_sample(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(t).view(-1, 3, 2, D // 2).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(-1, D)
        return a[1:] + t[:-1], torch.tanh(a).sum(0)

    def forward(self, x: raggedfn.Ragged) -> tuple[raggedfn.Ragged, torch.Tensor]:
        return raggedfn.map(self.per_sample, x)


def test_map_module_with_a_dense_output():
    torch.manual_seed(1)
    module = Encoder().eval()
    for ep in export(module, batch(EXAMPLE, 0)):
        for seed, lengths in enumerate(NEW[:2], 1):  # (an empty sample's mean is nan)
            x = batch(lengths, seed)
            out = ep.module()(x)
            expected = torch.stack([module.per_sample(t) for t in raggedfn.unbind(x)])
            torch.testing.assert_close(out, expected)
            torch.testing.assert_close(out, module(x))


def test_map_module_with_a_ragged_output():
    torch.manual_seed(2)
    module = Attend()
    for ep in export(module, batch(EXAMPLE, 0)):
        for seed, lengths in enumerate(([2, 7], [6, 2, 3, 9, 4], [5, 1, 2, 8]), 1):
            x = batch(lengths, seed)
            rows, pooled = ep.module()(x)
            samples = [module.per_sample(t) for t in raggedfn.unbind(x)]
            assert_ragged_equal(rows, [r for r, _ in samples])
            torch.testing.assert_close(pooled, torch.stack([p for _, p in samples]))
            eager_rows, eager_pooled = module(x)
            torch.testing.assert_close(rows.values, eager_rows.values)
            torch.testing.assert_close(pooled, eager_pooled)


class Pair(torch.nn.Module):
    """Two ragged inputs of equal lengths per sample (no data to compare while exporting)."""

    def forward(self, x: raggedfn.Ragged, y: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.map(lambda a, b: (a * torch.cumsum(b, 0)).amax(0), x, y)


def test_map_over_two_ragged_inputs():
    x, y = batch(EXAMPLE, 0), batch(EXAMPLE, 1)
    spec = (raggedfn.dynamic_shapes(x), raggedfn.dynamic_shapes(y))
    ep = torch.export.export(Pair(), (x, y), dynamic_shapes=spec)
    for seed, lengths in enumerate(NEW[:2], 2):
        x, y = batch(lengths, seed), batch(lengths, seed + 10)
        expected = [
            (a * torch.cumsum(b, 0)).amax(0)
            for a, b in zip(raggedfn.unbind(x), raggedfn.unbind(y), strict=True)
        ]
        torch.testing.assert_close(ep.module()(x, y), torch.stack(expected))
    # traced as one size: inputs whose lengths differ per sample raise (same total here)
    with pytest.raises(RuntimeError, match="ragged sizes differ from the trace"):
        ep.module()(batch([2, 7], 5), batch([7, 2], 6))


def test_nested_value_exports():
    class Documents(torch.nn.Module):
        def forward(self, x: raggedfn.Ragged) -> torch.Tensor:  # (B, S*, N*, D) -> [B, D]
            return raggedfn.sum(raggedfn.amax(x, 2), 1)

    def documents(sentences: list[list[int]], seed: int) -> raggedfn.Ragged:
        gen = torch.Generator().manual_seed(seed)
        flat = [n for doc in sentences for n in doc]
        values = torch.randn(sum(flat), D, generator=gen, dtype=torch.float64)
        return raggedfn.from_nested_lengths(values, [[len(doc) for doc in sentences], flat])

    x = documents([[2, 1], [1, 3, 2], [2, 2]], 0)
    exported = torch.export.export(Documents(), (x,), dynamic_shapes=(raggedfn.dynamic_shapes(x),))
    for ep in (exported, round_trip(exported)):
        for seed, sentences in enumerate(([[3, 1], [2]], [[1, 1, 4], [2, 2], [4], [1, 2]]), 1):
            x = documents(sentences, seed)
            expected = []
            for s, doc in enumerate(sentences):
                rows = x.values[x.offsets[s] : x.offsets[s + 1]].split(doc)
                expected.append(sum(r.amax(0) for r in rows))
            torch.testing.assert_close(ep.module()(x), torch.stack(expected))


def _branches(t: torch.Tensor) -> torch.Tensor:
    if t.shape[0] > 3:  # a size the trace decided on: a guard of the exported plan
        return t.sum(0)
    return t.mean(0)


class Branch(torch.nn.Module):
    def forward(self, x: raggedfn.Ragged) -> torch.Tensor:
        return raggedfn.map(_branches, x)


def test_sizes_the_program_specialized_raise_instead_of_answering():
    x = batch([4, 6, 5], 0)
    ep = export(Branch(), x)[0]
    ok = batch([7, 4], 1)
    torch.testing.assert_close(
        ep.module()(ok), torch.stack([t.sum(0) for t in raggedfn.unbind(ok)])
    )
    # a sample on the other side of the traced branch: the guard raises on the input
    with pytest.raises(RuntimeError, match=r"raggedfn.map: guard .* fails"):
        ep.module()(batch([7, 2, 5], 2))
    # torch specializes a batch of one sample (and of none): its input check raises
    for lengths in ([5], []):
        with pytest.raises(AssertionError, match=r"Guard failed: x.offsets.size\(\)\[0\] >= 3"):
            ep.module()(batch(lengths, 3))


def test_backed_size_oblivious_export_takes_batches_of_one():
    module = Pool()
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        ep = export(module, batch(EXAMPLE, 0))[0]
    for seed, lengths in enumerate(([4], [1], [2, 5]), 1):
        x = batch(lengths, seed)
        pooled, _ = ep.module()(x)
        expected = torch.stack([module.sample(t)[0] for t in raggedfn.unbind(x)])
        torch.testing.assert_close(pooled, expected)


# torch's own deepcopy of the graph's pytree spec while packaging warns (not raggedfn's)
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_aoti_package_runs_on_new_lengths(tmp_path):
    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(D, D)

        def per_sample(self, t: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.proj(t), 0).T @ t

        def forward(self, x: raggedfn.Ragged) -> torch.Tensor:
            return raggedfn.map(self.per_sample, x)

    torch.manual_seed(3)
    module = Small()
    x = batch(EXAMPLE, 0).with_values(batch(EXAMPLE, 0).values.float())
    ep = torch.export.export(module, (x,), dynamic_shapes=(raggedfn.dynamic_shapes(x),))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    run = torch._inductor.aoti_load_package(path)
    for seed, lengths in enumerate(NEW, 1):
        y = batch(lengths, seed)
        y = y.with_values(y.values.float())
        expected = torch.stack([module.per_sample(t) for t in raggedfn.unbind(y)])
        torch.testing.assert_close(run(y), expected)
