"""The main demo (``make demo``): build ragged batches, run ops, pad and unpad.

Later work turns this into a small per-sample transformer trained with
``raggedfn.map`` + ``torch.func.grad`` + ``torch.compile``.
"""

from __future__ import annotations

import torch

import raggedfn


def main() -> None:
    torch.manual_seed(0)
    lengths = torch.tensor([3, 0, 5, 2])
    tokens = raggedfn.from_lengths(torch.randn(int(lengths.sum()), 4), lengths)
    print("token batch:      ", tokens)
    pairs = raggedfn.from_list([torch.randn(n, n, 2) for n in (2, 3, 1)], ragged_dims=(1, 2))
    print("pair states:      ", pairs)
    padded = raggedfn.to_padded(tokens)
    print(
        "padded shape:     ",
        tuple(padded.shape),
        f"({tokens.values.shape[0]} real rows of {padded.shape[0] * padded.shape[1]})",
    )
    back = raggedfn.from_padded(padded, tokens.lengths)
    print("round trip equal: ", torch.equal(back.values, tokens.values))
    print("mask:\n", raggedfn.mask(tokens).int())
    print("sub-batch [2, 0]: ", tokens[torch.tensor([2, 0])])


if __name__ == "__main__":
    main()
