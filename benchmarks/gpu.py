"""Every registered suite on a GPU: ``python -m benchmarks.gpu [--quick]``.

The same suites, method and tables as ``python -m benchmarks.run``, with
``--device cuda``; the records go to ``benchmarks/results/<suite>[-quick]-cuda.json``
(and ``.md``/``.png``). Exits with status 2 and a message when no CUDA device is
available, so it can sit in a script that also runs on CPU-only machines.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from benchmarks import run


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device is available; nothing run", file=sys.stderr)
        return 2
    if "--device" in args:
        print("benchmarks.gpu: --device is always cuda here", file=sys.stderr)
        return 2
    return run.main(["--device", "cuda", *args])


if __name__ == "__main__":
    raise SystemExit(main())
