"""Benchmarks: raggedfn against padding, torch.nested and per-sample loops.

Run ``python -m benchmarks.run`` (``make bench``); see ``benchmarks/harness.py``
for the method and ``docs/benchmarks.md`` for the latest results.
"""
