"""tests/open_mpi_leftovers.py: which of Open MPI's session folders the sweep before each test
removes (a dead launcher's) and which it keeps."""
import os
import socket
import subprocess
import sys

import open_mpi_leftovers


def test_only_dead_launchers_folders_of_this_user_go(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = int(ended.stdout)  # a PID whose process has ended (and is not reused this soon)
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
    removed = open_mpi_leftovers.sweep(str(tmp_path))
    assert sorted(removed) == sorted([str(stale), str(tmp_path / f"prted.{dead}")])
    assert live.is_dir() and target.is_dir() and (tmp_path / f"ompi.{dead}.log").exists()
    assert (tmp_path / f"ompi.{dead + 1}").is_symlink()
