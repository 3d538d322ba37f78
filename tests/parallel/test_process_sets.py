"""DistributedTrainer / DistributedOptimizer on a process set: members train together, the
rank outside the set trains alone, as in Horovod."""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_trainer_on_a_subset(np_, tmp_path):
    out = run_ranks("process_set_trainer.py", np_, [str(tmp_path)], timeout=180).stdout
    assert out.count("all process set cases passed") == np_
    assert out.count("OK ") == 2 * np_
