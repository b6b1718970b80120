"""A pytest plugin for ``make mutate`` runs only (``tests/mutate.py`` loads it with ``-p``).

mutmut routes every call of a mutated function through its trampoline
(``mutmut/mutation/trampoline.py``). ``raggedfn.map``'s shape environment asks torch
for the frame that recorded a guard, skipping torch's "uninteresting" files, to tell a
branch in user code from torch's layout bookkeeping (``raggedfn/_map/tracing/_guards.py``);
a trampoline frame would be taken for user code, so every map test falls back to the
loop before any mutant is active. The trampoline is mutmut's plumbing, never user code:
it joins torch's skip list.
"""

from __future__ import annotations

from mutmut.mutation import trampoline
from torch.fx.experimental.symbolic_shapes import uninteresting_files

uninteresting_files().add(trampoline.__file__)
