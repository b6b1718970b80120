"""The token MLP, BERT and Pairformer-stack benchmark suites at tiny sizes.

Every system of every workload and mode must agree with the padded baseline
(forward outputs and, for ``fwd+bwd``, input and parameter gradients) through the
harness's own agreement check, so a benchmark never times a wrong computation.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from benchmarks import _systems, bert, harness, pairformer_stack, run, token_mlp
from benchmarks.harness import Case

# torch.nested's SDPA fallback and danling build strided nested tensors internally
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

LENGTHS = (3, 1, 5, 2)  # unequal, includes a length-1 sample
EAGER_MODES = ["fwd", "fwd+bwd"]


def _agree(suite: harness.Suite, case: Case, systems: list[str]) -> dict[str, harness.Step]:
    base = suite.build(case, "padded")
    expected = base.collect(base.run())
    steps = {}
    for system in systems:
        step = suite.build(case, system)
        got = step.collect(step.run())
        assert harness.disagreement(got, expected, case.dtype) == "", (case, system)
        steps[system] = step
    return steps


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("mode", EAGER_MODES)
@pytest.mark.parametrize("workload", list(token_mlp.WIDTHS))
def test_token_mlp_systems_agree(workload: str, mode: str) -> None:
    case = Case("token_mlp", workload, mode, "lognormal", LENGTHS, {}, dtype=torch.float64)
    systems = ["raggedfn", "map", "nested", "danling", "loop"]
    if _danling_missing():
        systems.remove("danling")
    _agree(token_mlp.SUITE, case, systems)


@pytest.mark.parametrize("mode", EAGER_MODES)
@pytest.mark.parametrize("scale", ["tiny", "mini"])
def test_bert_systems_agree(scale: str, mode: str) -> None:
    case = Case("bert", scale, mode, "lognormal", LENGTHS, {}, dtype=torch.float64)
    systems = ["raggedfn", "map", "nested", "danling", "loop"]
    if _danling_missing():
        systems.remove("danling")
    _agree(bert.SUITE, case, systems)


def test_bert_equal_lengths_and_float32() -> None:
    case = Case("bert", "tiny", "fwd+bwd", "equal", (4, 4, 4), {})
    _agree(bert.SUITE, case, ["raggedfn", "map", "nested", "loop"])


def test_bert_compiled_systems_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled raggedfn and padded agree and record compile time and graphs."""
    monkeypatch.setattr(_systems, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    monkeypatch.setattr(_systems, "_COMPILED", {})
    case = Case("bert", "tiny", "fwd+bwd compiled", "lognormal", LENGTHS, {}, dtype=torch.float64)
    with warnings.catch_warnings():
        # dynamo instantiates raggedfn's autograd Functions while tracing (torch 2.13)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        # dynamo reads .grad of a non-leaf while resuming after a graph break
        warnings.filterwarnings("ignore", message="The .grad attribute", category=UserWarning)
        steps = _agree(bert.SUITE, case, ["raggedfn"])
    for step in steps.values():
        assert step.extra["graphs"] >= 1
        assert step.extra["compile_s"] >= 0
    for system in ("map", "loop", "nested", "danling"):
        with pytest.raises(harness.Missing, match="eagerly only"):
            bert.SUITE.build(case, system)


@pytest.mark.parametrize("workload", list(pairformer_stack.MODE_OF))
def test_pairformer_stack_systems_agree(workload: str) -> None:
    mode = pairformer_stack.MODE_OF[workload]
    params = {**pairformer_stack.SUITE.params(True), "blocks": 2, "blocks_fwd_bwd": 2}
    case = Case("pairformer_stack", workload, mode, "pair_high", (5, 2, 7), params)
    _agree(pairformer_stack.SUITE, case, ["raggedfn", "loop"])


def test_wrong_system_is_caught() -> None:
    """The agreement check is not vacuous: a perturbed gradient is reported."""
    case = Case("bert", "tiny", "fwd+bwd", "lognormal", LENGTHS, {}, dtype=torch.float64)
    base = bert.SUITE.build(case, "padded")
    expected = base.collect(base.run())
    step = bert.SUITE.build(case, "raggedfn")
    got = step.collect(step.run())
    got[len(LENGTHS) + 2] = got[len(LENGTHS) + 2] * 1.01  # one sample's input gradient
    assert "sample 6 differs" in harness.disagreement(got, expected, case.dtype)


def test_sized_cases_and_ideal() -> None:
    cases = bert.SUITE.cases(quick=False)
    compiled = {c.distribution for c in cases if c.mode.endswith("compiled")}
    assert compiled == set(bert.COMPILED_ON)
    base = next(c for c in cases if c.workload == "base")
    assert len(base.lengths) == bert.SIZES[False]["base"][0]
    assert all(0 < bert.ideal_ratio(c) <= 1 for c in cases)
    equal = next(c for c in cases if c.distribution == "equal")
    assert bert.ideal_ratio(equal) == pytest.approx(1.0)
    stack = pairformer_stack.SUITE.cases(quick=False)
    assert {(c.workload, c.mode) for c in stack} == {("stack", "fwd"), ("stack/2", "fwd+bwd")}
    for suite in (bert.SUITE, token_mlp.SUITE, pairformer_stack.SUITE):
        for quick in (False, True):
            for c in suite.cases(quick=quick):  # the record lists every workload's lengths
                assert c.params["lengths"][c.distribution][c.workload] == list(c.lengths)
    for name in ("token_mlp", "bert", "pairformer_stack"):
        assert name in run.SUITES


def test_run_suite_summary_and_writers(tmp_path: pytest.TempPathFactory) -> None:
    """A tiny run through the harness: cells ok, geometric-mean summary in the markdown."""
    suite = dataclasses.replace(
        token_mlp.SUITE,
        sizes=lambda quick: {"mlp-256": (3, 0.05), "mlp-1024": (2, 0.05)},
        distributions=lambda quick: ["lognormal"],
        modes=["fwd"],
    )
    record = harness.run_suite(
        suite,
        quick=False,
        threads=1,
        warmup=0,
        repeats=3,
        memory=False,
        systems=["padded", "raggedfn", "loop"],
        max_seconds=0.5,
    )
    assert all(c["status"] == "ok" for c in record["cells"]), record["cells"]
    text = harness.markdown_report(record)
    assert "lognormal, fwd, raggedfn: geometric-mean speedup over padded" in text
    assert "across mlp-256, mlp-1024" in text
    harness.write_json(record, tmp_path / "r.json")
    assert (tmp_path / "r.json").read_text().startswith("{")


def _danling_missing() -> bool:
    try:
        import danling  # noqa: F401
    except ImportError:
        return True
    return False


def test_distributed_sampler_rows_and_report() -> None:
    from benchmarks import distributed

    rows = distributed.sampler_rows(3000, budgets=(1024,), replicas=(1, 4))
    assert [r["num_replicas"] for r in rows] == [1, 4]
    assert all(r["equal_batch_counts"] and 0.9 <= r["fill_mean"] <= 1.0 for r in rows)
    assert rows[0]["rank_spread"] == 0.0 and rows[1]["rank_spread"] <= 0.1
    collective = {"samples": 8, "bytes_per_rank": 2**20, "header_bytes_per_rank": 32848}
    collective |= {"tiny_ms": 0.25, "header_ms": 0.5, "single_ms": 1.0, "ragged_ms": 2.0}
    collective |= {"known_ms": 1.1, "ratio": 2.0, "floor_ratio": 1.5, "known_ratio": 1.1}
    text = distributed.markdown({"sampler": rows, "collectives": [collective]})
    assert "| 1024 | 4 |" in text and "(32.08 KiB per rank" in text
    assert "| 1 MiB | 8 | 0.250 | 0.500 | 1.000 | 2.000 | 2.00x | 1.50x | 1.100 | 1.10x |" in text
    cpu = distributed.cpu_rows(batches=(3,), rounds=1, number=2)
    assert [r["samples"] for r in cpu] == [3] and all(v > 0 for v in cpu[0].values())
    assert "| 3 | " in distributed.markdown({"sampler": rows, "collectives": [], "cpu": cpu})
    # the payloads are the bytes named, in at least 2 lognormal samples
    for nbytes in (2**10, 2**16, 3 * 2**20):
        x = distributed._batch(0, nbytes, distributed.DIM)
        assert x.values.numel() * 4 == nbytes and x.batch_size >= 2
        assert int(x.lengths.min()) >= 1
