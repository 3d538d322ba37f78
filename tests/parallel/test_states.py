"""save_states / load_states are local: one rank alone or every rank with its own path."""
import pytest

from runner import case_job, case_names


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("states")


@pytest.mark.parametrize("case", case_names("states_worker.py"))
@pytest.mark.parametrize("np_", [3])
def test_states_are_local(np_, folder, case):
    where = folder / str(np_)
    where.mkdir(exist_ok=True)
    case_job("states_worker.py", np_, [str(where)], timeout=180).check(case)
