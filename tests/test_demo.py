"""Smoke test of the main demo at a tiny size, and its padded twin agreeing with it."""

import torch

import raggedfn
from examples import demo


def test_demo_runs_small(capsys):
    code = demo.main(
        [
            "--steps",
            "3",
            "--batch",
            "4",
            "--max-len",
            "8",
            "--no-compile",
            "--no-compare",
            "--min-accuracy",
            "0",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out


def test_demo_fails_below_accuracy_threshold(capsys):
    code = demo.main(
        [
            "--steps",
            "1",
            "--batch",
            "2",
            "--max-len",
            "6",
            "--no-compile",
            "--no-compare",
            "--min-accuracy",
            "1.01",
        ]
    )
    assert code == 1
    assert "FAILED" in capsys.readouterr().out


def test_padded_loss_equals_ragged_loss_and_grads():
    gen = torch.Generator().manual_seed(3)
    params = demo.init_params(2)
    tokens, labels = demo.make_batch(gen, 6, 12)
    padded, keep = raggedfn.to_padded(tokens), raggedfn.mask(tokens)
    g_ragged, l_ragged = torch.func.grad_and_value(demo.ragged_loss)(params, tokens, labels)
    g_padded, l_padded = torch.func.grad_and_value(demo.padded_loss)(params, padded, keep, labels)
    torch.testing.assert_close(l_ragged, l_padded)
    for name in params:
        torch.testing.assert_close(g_ragged[name], g_padded[name], msg=name)
    # and both equal the per-sample loop of the per-sample model
    logits = torch.stack([demo.model(t, params) for t in raggedfn.unbind(tokens)])
    torch.testing.assert_close(l_ragged, torch.nn.functional.cross_entropy(logits, labels))


def test_labels_follow_the_rule():
    gen = torch.Generator().manual_seed(0)
    tokens, labels = demo.make_batch(gen, 16, 20)
    for sample, label in zip(raggedfn.unbind(tokens), labels.tolist(), strict=True):
        odd = int((sample % 2).sum())
        assert label == int(odd > len(sample) - odd)


def test_demo_step_compiles_fullgraph_without_recompiling():
    """The demo's step (map + grad_and_value, mean over the ragged axis) compiles fullgraph.

    backend="eager" keeps it quick: this checks dynamo capture (no graph break, one
    graph over new lengths); the inductor path runs in ``make demo``.
    """
    gen = torch.Generator().manual_seed(5)
    params = demo.init_params(0)
    step = torch.func.grad_and_value(demo.ragged_loss)
    tokens, labels = demo.make_batch(gen, 5, 12)
    step(params, tokens, labels)  # map traces f eagerly once per signature
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="eager")
    _run_compiled(compiled, step, params, gen)
    # one graph, plus at most one recompile where the first packed size happened to
    # equal a dense size (duck sizing ties them; docs/compile.md)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def _run_compiled(compiled, step, params, gen):
    for _ in range(6):
        tokens, labels = demo.make_batch(gen, 5, 12)
        raggedfn.mark_dynamic(tokens)
        grads, loss = compiled(params, tokens, labels)
        want_grads, want_loss = step(params, tokens, labels)
        torch.testing.assert_close(loss, want_loss)
        for name in params:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)


def test_demo_comparison_table_at_tiny_size(capsys):
    import argparse

    args = argparse.Namespace(batch=3, compare_dim=8, compare_max_len=8, threads=1, repeats=1)
    demo.compare(args)
    out = capsys.readouterr().out
    assert "padded" in out and "raggedfn" in out and "MiB" in out
