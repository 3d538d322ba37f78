"""Mismatch messages name the collective, the field, the tensor and each rank's value."""
from hvd_trainer.diagnostics import describe_mismatch


def test_names_first_differing_top_level_field():
    every = [{"kind": "broadcast", "name": "w", "root_rank": 0},
             {"kind": "broadcast", "name": "w", "root_rank": 1}]
    assert describe_mismatch(every) == \
        "broadcast 'w': ranks disagree on root_rank (rank 0: 0, rank 1: 1)"


def test_names_tensor_and_field_inside_a_group():
    t = {"name": "g.0", "dtype": "<f4", "shape": (2,)}
    every = [{"kind": "grouped_allreduce", "name": "g", "tensors": [t, dict(t, name="g.1")]},
             {"kind": "grouped_allreduce", "name": "g",
              "tensors": [t, dict(t, name="g.1", dtype="<f2")]}]
    assert describe_mismatch(every) == ("grouped_allreduce 'g': ranks disagree on dtype of tensor 1 "
                                        "'g.1' (rank 0: '<f4', rank 1: '<f2')")


def test_names_missing_tensors():
    t = {"name": "a", "dtype": "<f4", "shape": (1,)}
    every = [{"kind": "grouped_allreduce", "name": "g", "tensors": [t, t]},
             {"kind": "grouped_allreduce", "name": "g", "tensors": [t]}]
    assert "number of tensors (rank 0: 2, rank 1: 1)" in describe_mismatch(every)
