"""Triangle packing of symmetric factors (spd-kfac's wire format) and bucket planning."""

from __future__ import annotations

import pytest
import torch

from dpkfac.comm import bucket_plan, pack_triangle, triangle_numel, unpack_triangle


@pytest.mark.parametrize("dim", [1, 2, 3, 17, 64, 130])
def test_pack_unpack_round_trip_is_exact(dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(dim, dim, dtype=torch.float64, generator=gen)
    sym = x + x.T
    packed = pack_triangle(sym)
    assert packed.shape == (triangle_numel(dim),) == (dim * (dim + 1) // 2,)
    rows, cols = torch.triu_indices(dim, dim)
    assert torch.equal(packed, sym[rows, cols])  # row-major upper triangle, diagonal included
    assert torch.equal(unpack_triangle(packed, dim), sym)
    # Non-contiguous input packs the same values.
    assert torch.equal(pack_triangle(sym.T), packed)


def test_unpack_of_a_reduced_buffer_is_symmetric() -> None:
    """What all-reduce returns (a sum of packed triangles) unpacks to the summed matrix."""
    a, b = torch.randn(5, 5), torch.randn(5, 5)
    a, b = a + a.T, b + b.T
    assert torch.equal(unpack_triangle(pack_triangle(a) + pack_triangle(b), 5), a + b)


def test_bucket_plan_splits_by_dtype_and_cap() -> None:
    tensors = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    numels = [t.numel() for t in tensors]
    assert bucket_plan(tensors, numels, None) == [[0, 2], [1]]
    assert bucket_plan(tensors, numels, 100) == [[0], [2], [1]]
