"""Segment primitives: the only place in raggedfn with custom autograd rules.

Interface shared by every primitive: ``values [T, *rest]`` (one packed row per
leading index), ``segments [T]`` int64 (the output row of each packed row, in
``[0, num_segments)``, any order) and ``num_segments`` (a Python int, so every
output shape is static and nothing syncs with the host). The same primitive
serves the single ragged axis of a token batch (segment = sample) and one
ragged axis of an ``[N_i, M_i]`` batch (segment = sample and remaining
coordinate, flattened). Empty segments: sum 0, mean NaN, product 1, max/min
the identity with arg -1, logsumexp -inf; gradients stay finite (an empty segment
has no row to receive one), and so do forward-mode tangents, except the mean's:
NaN, as ``torch.mean`` of an empty tensor.

Custom ``torch.autograd.Function`` rules (torch.func form: ``forward`` without
ctx, ``setup_context``, a backward built from other primitives,
``generate_vmap_rule = True``, always called through a plain function):
``segment_amax``/``segment_amin`` (ties share the gradient, as ``torch.amax``;
``segment_max``/``segment_min`` add the non-differentiable arg index),
``segment_softmax``, ``segment_log_softmax``, ``segment_prod`` (exact with zeros,
and vmap-able, unlike ``scatter_reduce``'s own rule), ``segment_matmul`` and
``segment_outer`` (grouped GEMMs for experts, each the other's derivative, with
forward-mode rules), the NaN of ``segment_mean``'s empty segments (a zero gradient,
a NaN tangent, as ``torch.mean`` of an empty tensor), and the dense
``scaled_dot_product_attention`` (saves the row logsumexp, not the
probabilities, so a bias gradient does not keep the softmax alive). Everything else is a composite of
differentiable torch ops, which is as fast and needs no rule of its own.

Forward mode (``_forward.py``): each Function has a subclass with an explicit
``jvp`` rule, also built from primitives (so ``hessian`` and ``jacrev(jacfwd)``
work), used by eager calls; while dynamo traces, the jvp-less base class is used
(dynamo 2.13 refuses a custom ``jvp``). :func:`has_tangent` tells the ops when a
forward-mode tangent may be present (``attention`` then avoids torch's fused CPU
kernel, which has no forward-mode derivative).

Two ``torch.library`` custom-op pairs serve compiled code only (ops call them
while ``torch.compiler.is_compiling()``): ``host_planned`` runs an op that plans
on the host (bucketed products, attention) as one opaque node, backward by
recomputation (``_opaque.py``); ``varlen_attention`` runs plain attention with
the fused SDPA kernel per sample and its own backward (``_varlen.py``). Both
are opaque to ``torch.func`` and to double backward inside compiled code (those
raise; forward mode raises ``RaggedError``, see ``docs/transforms.md``).
"""

from ._cumsum import segment_cumsum
from ._extrema import identity, segment_amax, segment_amin, segment_max, segment_min
from ._forward import forward_mode, has_tangent
from ._grouped import segment_matmul, segment_outer
from ._mean import segment_mean
from ._opaque import host_planned, implement
from ._prod import segment_prod
from ._sdpa import scaled_dot_product_attention
from ._segment import (
    broadcast,
    pad,
    segment_counts,
    segment_sum,
    take_rows,
    unpad,
)
from ._softmax import block_softmax, segment_log_softmax, segment_logsumexp, segment_softmax
from ._varlen import varlen_attention

__all__ = [
    "block_softmax",
    "broadcast",
    "forward_mode",
    "has_tangent",
    "host_planned",
    "identity",
    "implement",
    "pad",
    "scaled_dot_product_attention",
    "segment_counts",
    "segment_cumsum",
    "segment_amax",
    "segment_amin",
    "segment_log_softmax",
    "segment_logsumexp",
    "segment_max",
    "segment_matmul",
    "segment_mean",
    "segment_min",
    "segment_outer",
    "segment_prod",
    "segment_softmax",
    "segment_sum",
    "take_rows",
    "unpad",
    "varlen_attention",
]
