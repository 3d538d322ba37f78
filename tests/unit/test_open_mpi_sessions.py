"""files.open_mpi_sessions: which of Open MPI's session folders the sweep before a launch
removes (those its killed launchers left) and which it keeps."""
import os
import socket
import subprocess
import sys

import pytest

from hvd_trainer_launch.files import open_mpi_sessions


def _dead_pid() -> int:
    """A PID whose process has ended (and is not reused this soon)."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    return int(ended.stdout)


def test_dead_launchers_folders_go_and_the_rest_stay(tmp_path):
    dead = _dead_pid()
    stale = tmp_path / f"ompi.{dead}"
    stale.mkdir()
    with socket.socket(socket.AF_UNIX) as left:  # what a killed prterun leaves there
        left.bind(str(stale / f"pmix.vm.tool.{dead}"))
    (tmp_path / f"prted.{dead}").mkdir()
    live = tmp_path / f"ompi.{os.getpid()}"
    live.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"ompi.{dead + 1}").symlink_to(target)
    (tmp_path / f"ompi.{dead}.log").write_text("not a session folder")
    removed = open_mpi_sessions.sweep(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(tmp_path / f"prted.{dead}")])
    assert not stale.exists()
    assert live.is_dir() and target.is_dir() and (tmp_path / f"ompi.{dead}.log").exists()
    assert (tmp_path / f"ompi.{dead + 1}").is_symlink()


def test_a_folder_whose_socket_answers_stays_though_no_process_here_has_its_pid(tmp_path):
    # Its launcher runs in a PID namespace out of sight (a container sharing the folder).
    dead = _dead_pid()
    folder = tmp_path / f"ompi.{dead}"
    folder.mkdir()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(folder / f"pmix.vm.tool.{dead}"))
        server.listen()
        assert open_mpi_sessions.sweep(str(tmp_path)) == []
        assert folder.is_dir()
    assert open_mpi_sessions.sweep(str(tmp_path)) == [str(folder)]  # closed: stale now


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another user")
def test_a_folder_of_another_user_stays(tmp_path):
    dead = _dead_pid()
    folder = tmp_path / f"prted.{dead}"
    folder.mkdir()
    os.chown(folder, 65534, 65534)
    assert open_mpi_sessions.sweep(str(tmp_path)) == []
    assert folder.is_dir()
