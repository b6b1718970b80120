"""Runnable example programs (outside the package; see README.md, "Examples").

Each is a script (``python examples/NAME.py --help``); this file only lets the test
suite import them as ``examples.NAME``.
"""
