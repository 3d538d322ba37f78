"""save_states / load_states are local: one rank alone or every rank with its own path."""
import pytest

from runner import run_ranks


@pytest.mark.parametrize("np_", [2, 3])
def test_states_are_local(np_, tmp_path):
    out = run_ranks("states_worker.py", np_, [str(tmp_path)], timeout=180).stdout
    assert out.count("all states cases passed") == np_
    assert out.count("OK ") == 3
