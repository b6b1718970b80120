"""A Hugging Face BERT through ``raggedfn.map`` inside ``torch.compile(fullgraph=True,
dynamic=True)``: one analysis of the frame, one graph, attention as the varlen custom op.

One small model (1 layer, built from a config, float64) is compiled once for the
module (aot_eager: the graph and its backward, without inductor's code generation);
every test reads the same run over three batches of new lengths.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import raggedfn

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings(
    "ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
    ":DeprecationWarning"
)

VOCAB, HIDDEN = 50, 16
BATCHES = ([5, 9, 3], [7, 2, 6, 4], [8, 3])


def _model() -> Any:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False).double().train()


MODEL = _model()


def one(t: torch.Tensor, pos: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """One sequence of ids -> its last hidden states (positions and token types passed)."""
    kwargs = {"position_ids": pos[None], "token_type_ids": torch.zeros_like(t)[None]}
    return torch.func.functional_call(MODEL, p, (t[None],), kwargs).last_hidden_state[0]


def forward(values, offsets, sizes, p):
    tokens = raggedfn.Ragged(values, offsets, sizes, raggedfn.Layout.standard(1, 0))
    out = raggedfn.map(one, tokens, raggedfn.positions(tokens), p, in_dims=(0, 0, None))
    return out.values


def _batch(lengths: list[int], seed: int) -> raggedfn.Ragged:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (sum(lengths),), generator=gen)
    return raggedfn.from_lengths(ids, lengths)


def _padded(p: dict[str, torch.Tensor], tokens: raggedfn.Ragged) -> torch.Tensor:
    """The HF padded model with an attention mask: the independent reference."""
    ids = raggedfn.to_padded(tokens)
    mask = raggedfn.to_padded(raggedfn.map(torch.ones_like, tokens))
    out = torch.func.functional_call(MODEL, p, (ids,), {"attention_mask": mask})
    return out.last_hidden_state[mask.bool()]


def _loss_and_grads(fn, p, cotangent):
    out = fn(p)
    grads = torch.autograd.grad((out * cotangent).sum(), list(p.values()))
    return out.detach(), dict(zip(p, grads, strict=True))


@functools.cache
def compiled_run() -> dict[str, Any]:
    """Three batches through the compiled forward (and its backward), with what dynamo did."""
    p = {k: v.detach().requires_grad_() for k, v in MODEL.named_parameters()}
    forward(*_fields(_batch(BATCHES[0], 0)), p)  # the eager trace of ``one``
    targets: set[str] = set()

    def backend(gm, example_inputs):
        targets.update(str(node.target) for node in gm.graph.nodes)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(forward, fullgraph=True, dynamic=True, backend=backend)
    runs = []
    for i, lengths in enumerate(BATCHES):
        tokens = _batch(lengths, i)
        cotangent = torch.randn(sum(lengths), HIDDEN, dtype=torch.float64)
        got = _loss_and_grads(lambda q, t=tokens: compiled(*_fields(t), q), p, cotangent)
        eager = _loss_and_grads(lambda q, t=tokens: forward(*_fields(t), q), p, cotangent)
        padded = _loss_and_grads(lambda q, t=tokens: _padded(q, t), p, cotangent)
        runs.append((got, eager, padded))
    return {
        "runs": runs,
        "graphs": counters["stats"]["unique_graphs"],
        "backend_calls": counters["aot_autograd"]["total"],
        "targets": targets,
    }


def _fields(x: raggedfn.Ragged) -> tuple[torch.Tensor, ...]:
    return x.values, x.offsets, x.sizes


def test_compiled_map_of_a_bert_equals_eager_map_and_the_padded_model():
    for (got, got_grads), (eager, eager_grads), (padded, padded_grads) in compiled_run()["runs"]:
        torch.testing.assert_close(got, eager, atol=1e-9, rtol=0)
        torch.testing.assert_close(got, padded, atol=1e-9, rtol=0)
        for key in padded_grads:
            torch.testing.assert_close(got_grads[key], eager_grads[key], atol=1e-9, rtol=0)
            torch.testing.assert_close(got_grads[key], padded_grads[key], atol=1e-9, rtol=0)


def test_one_graph_from_one_analysis_of_the_frame():
    # Python floats of the model (dropout p, layer-norm eps, the attention scale) are
    # constants, not graph inputs: before, dynamo's tensorify pass restarted the
    # analysis (and the backend compile) once for every few of them
    run = compiled_run()
    assert run["graphs"] == 1
    assert run["backend_calls"] == 1


def test_attention_is_the_varlen_custom_op_pair():
    # the fused kernel per sample with its own backward, not the packed pair products
    targets = compiled_run()["targets"]
    assert any("varlen_attention" in t for t in targets), sorted(targets)
