"""Weight deltas (harness/weight_sync/deltas.py): what the sender encodes against what it sent last, and
the receiver's writes of a sparse update. The deltas' round trip through a real gloo broadcast to the
built-in server is in tests/test_weight_sync.py."""

from __future__ import annotations

import torch

from harness.weight_sync.deltas import DeltaEncoder, SparseUpdate, apply_sparse, sparse_nbytes


def test_the_first_sync_of_a_tensor_travels_whole_and_later_ones_as_their_changed_elements():
    encoder = DeltaEncoder()
    before = torch.randn(64, 32, dtype=torch.bfloat16)
    assert encoder.encode("w", before, as_delta=True) is before  # nothing to compare with yet
    after = before.clone()
    after[3, 4] += 1.0
    after[60, 31] = -after[60, 31]
    update = encoder.encode("w", after, as_delta=True)
    assert isinstance(update, SparseUpdate)
    assert update.positions.dtype == torch.int32
    assert update.positions.tolist() == [3 * 32 + 4, 60 * 32 + 31]
    assert torch.equal(update.values, after.reshape(-1)[[3 * 32 + 4, 60 * 32 + 31]])
    assert update.nbytes == sparse_nbytes(2, 2) == 12
    served = before.clone()
    apply_sparse(served, update)
    assert torch.equal(served, after)
    assert encoder.encode("w", after, as_delta=True).positions.numel() == 0  # unchanged: nothing to send


def test_a_tensor_with_many_changes_or_sent_whole_travels_whole_and_is_remembered():
    encoder = DeltaEncoder()
    encoder.encode("w", torch.zeros(30), as_delta=False)
    many = torch.zeros(30)
    many[:11] = 1.0  # more than a third of the elements
    assert encoder.encode("w", many, as_delta=True) is many
    one = many.clone()
    one[29] = 2.0
    assert encoder.encode("w", one, as_delta=False) is one  # a whole sync still updates the memory
    assert encoder.encode("w", one, as_delta=True).positions.numel() == 0
    assert encoder.remembers(["w"]) and not encoder.remembers(["w", "v"])
    ((name, remembered),) = encoder.remembered(["w"])
    assert name == "w" and torch.equal(remembered, one)


def test_changes_are_found_bit_for_bit():
    encoder = DeltaEncoder()
    before = torch.tensor([0.0, float("nan"), 1.0, 2.0])
    encoder.encode("w", before, as_delta=False)
    after = torch.tensor(
        [
            -0.0,
            float("nan"),
            1.0,
            2.0,
        ]
    )  # -0.0 == 0.0 numerically, not in bits
    update = encoder.encode("w", after.clone(), as_delta=True)
    assert update.positions.tolist() == [0]  # the same NaN is no change
    served = before.clone()
    apply_sparse(served, update)
    assert torch.signbit(served[0]) and torch.isnan(served[1])


def test_a_sparse_update_lands_in_a_strided_target_and_in_its_dtype():
    weight = torch.zeros(4, 6)
    target = weight.t()  # [6, 4], not contiguous
    update = SparseUpdate(
        torch.tensor([1, 22], dtype=torch.int32), torch.tensor([5.0, 7.0], dtype=torch.float64)
    )
    apply_sparse(target, update)
    assert target.reshape(-1)[1] == 5.0 and target.reshape(-1)[22] == 7.0
    assert int((weight != 0).sum()) == 2 and weight.dtype == torch.float32
