"""device.py's packed upload of a step's integer lists; verifier.py's sampling rows picked from per-row tables."""
import pytest
import torch

from nano_sparsespec.config import SamplingParams
from nano_sparsespec.device import Packed, long_tensor
from nano_sparsespec.verifier import SamplingTensors


def test_packed_lists_come_back_as_named_tensors_of_their_shapes():
    packed = Packed({"ids": [5, 6, 7], "rows": [[1, 2], [3, 4]], "empty": [], "zero_width": [[], []]})
    got = packed.views()
    assert got["ids"].tolist() == [5, 6, 7] and got["ids"].dtype == torch.long
    assert got["rows"].tolist() == [[1, 2], [3, 4]]
    assert got["empty"].shape == (0,) and got["zero_width"].shape == (2, 0)
    got["ids"][0] = 9                                   # views of one copy: writing one leaves the others alone
    assert got["rows"].tolist() == [[1, 2], [3, 4]]
    assert packed.flat.tolist() == [9, 6, 7, 1, 2, 3, 4]


def test_packed_tensors_and_lists_keep_their_order():
    """CPU tensors (lists made at once for a batch) travel beside Python lists, in the order given."""
    packed = Packed({"ids": [5, 6], "rows": torch.tensor([[1, 2], [3, 4]]), "flags": torch.tensor([True, False]),
                     "changes": [[7, 8, 9]], "last": torch.tensor([10])})
    assert packed.shapes == {"ids": (2,), "rows": (2, 2), "flags": (2,), "changes": (1, 3), "last": (1,)}
    assert packed.flat.tolist() == [5, 6, 1, 2, 3, 4, 1, 0, 7, 8, 9, 10] and packed.flat.dtype == torch.long
    got = packed.views()
    assert got["rows"].tolist() == [[1, 2], [3, 4]] and got["last"].tolist() == [10]


def test_a_static_copy_holds_a_leading_part_of_the_layout():
    packed = Packed({"ids": [5, 6], "rows": [[1, 2]], "changes": [7, 8, 9]})
    static = torch.zeros(packed.size(["ids", "rows"]), dtype=torch.long)
    static.copy_(packed.flat[:static.shape[0]])
    got = packed.views(static, ["ids", "rows"])
    assert list(got) == ["ids", "rows"] and got["rows"].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="not a leading part"):
        packed.views(static, ["rows"])


def test_long_tensor_keeps_every_int():
    ints = [0, -1, 2**62, -2**63, 7]
    got = long_tensor(ints)
    assert got.dtype == torch.long and got.tolist() == ints
    assert long_tensor([]).shape == (0,)
    with pytest.raises(OverflowError, match="9223372036854775808 does not fit a 64-bit integer"):
        long_tensor([1, 2**63])


def test_packed_lists_reject_ragged_rows_by_name():
    with pytest.raises(ValueError, match="logit_rows: rows of 2 and 3 values"):
        Packed({"logit_rows": [[1, 2], [3, 4, 5]]})


def test_selected_sampling_rows_take_their_flags_from_their_own_requests():
    table = SamplingTensors.from_params([SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
                                         SamplingParams(temperature=1.0)], [1, 2, 3])
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    st = table.select(torch.tensor([0, 2]), SamplingTensors.host_flags(params))
    assert st.seed.tolist() == [1, 3] and st.greedy.tolist() == [True, False]
    assert (st.use_filter, st.all_greedy, st.any_greedy) == (False, False, True)   # row 1's top_p is not selected
    assert table.select(torch.tensor([0]), SamplingTensors.host_flags([SamplingParams()])).all_greedy
