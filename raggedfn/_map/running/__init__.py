"""Running a plan on a batch: the interpreter, per-sample fallbacks, splits, chunks, row tiles and blocks."""
