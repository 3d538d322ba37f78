"""hvd_trainer.run without launching: horovod.run's arguments refused or mapped onto hvdrun's
flags, and the signed files that carry the function and the results (owner-only, never over
an existing file, never unpickled unless their signature checks out)."""
import os
import pickle
import stat

import pytest

import hvd_trainer
from hvd_trainer_launch.engines import run as runner
from hvd_trainer_launch.engines.calls import Outcome
from hvd_trainer_launch.files import signed as signed_files

SECRET = b"s" * 32


@pytest.mark.parametrize("name, value", [
    ("min_num_proc", 2), ("max_num_proc", 4), ("min_np", 2), ("max_np", 4), ("slots", 2),
    ("reset_limit", 1), ("cooldown_range", (1, 2)), ("host_discovery_script", "d.sh"),
    ("use_gloo", True)])
def test_refused_arguments_are_named_before_anything_starts(name, value):
    with pytest.raises(ValueError, match=f"hvd_trainer.run: {name}=.* is not supported: "):
        hvd_trainer.run(print, **{name: value})


@pytest.mark.parametrize("kwargs, message", [
    ({"hosts": "a:1", "hostfile": "h"}, "give hosts or hostfile, not both"),
    ({"num_proc": 0}, "num_proc=0 must be an int >= 1"),
    ({"num_proc": 1.5}, "num_proc=1.5 must be an int >= 1")])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hvd_trainer.run(print, **kwargs)


def test_accepted_arguments_become_hvdrun_flags():
    given = {"hosts": "a:2,b:2", "start_timeout": 30, "ssh_port": 2222,
             "ssh_identity_file": "/k", "output_filename": "/o", "disable_cache": True,
             "verbose": True, "use_mpi": True, "mpi_args": "-l -x", "hostfile": None,
             "network_interfaces": ["eth0", "ib0"], "horovod": True}
    assert runner._hvdrun_flags(4, given) == [
        "-np", "4", "-H", "a:2,b:2", "--start-timeout", "30", "-p", "2222", "-i", "/k",
        "--output-filename", "/o", "--disable-cache", "--verbose", "--mpi", "--horovod",
        "--mpi-args=-l -x", "--network-interfaces", "eth0,ib0"]
    assert runner._hvdrun_flags(2, {}) == ["-np", "2"]


def test_a_signed_file_is_owner_only_and_round_trips(tmp_path):
    signed_files.write_signed(os.path.join(str(tmp_path), "result.0"), SECRET, pickle.dumps({"x": 1}))
    assert stat.S_IMODE(os.stat(tmp_path / "result.0").st_mode) == 0o600
    assert pickle.loads(signed_files.read_signed(os.path.join(str(tmp_path), "result.0"), SECRET)) == {"x": 1}


def test_a_signed_file_never_replaces_a_file_or_follows_a_link(tmp_path):
    (tmp_path / "target").write_bytes(b"")
    os.symlink(tmp_path / "target", tmp_path / "result.1")
    (tmp_path / "result.2").write_bytes(b"")
    for label in ("result.1", "result.2"):
        with pytest.raises(FileExistsError):
            signed_files.write_signed(os.path.join(str(tmp_path), label), SECRET, b"x")
    assert (tmp_path / "target").read_bytes() == b""


LOADED = []


def record(what):
    LOADED.append(what)


class Trap:
    """Unpickling it records that it happened, in LOADED."""

    def __reduce__(self):
        return record, ("unpickled",)


def test_signatures_are_checked_per_file_and_key(tmp_path):
    folder = str(tmp_path)
    signed_files.write_signed(os.path.join(folder, "result.0"), SECRET, b"payload")
    data = (tmp_path / "result.0").read_bytes()
    (tmp_path / "result.1").write_bytes(data)  # another rank's label
    (tmp_path / "tampered").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    for label in ("result.1", "tampered"):
        os.chmod(tmp_path / label, 0o600)
    for label, secret in (("result.0", b"t" * 32), ("result.1", SECRET), ("tampered", SECRET)):
        with pytest.raises(ValueError, match="fails its signature check"):
            signed_files.read_signed(os.path.join(folder, label), secret)
    os.chmod(tmp_path / "result.0", 0o644)
    with pytest.raises(ValueError, match="not an owner-only file"):
        signed_files.read_signed(os.path.join(folder, "result.0"), SECRET)


def tamper(path):
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))


def test_the_ranks_unpickle_only_a_verified_function(tmp_path, monkeypatch):
    folder = str(tmp_path)
    signed_files.write_signed(os.path.join(folder, "function"), SECRET,
                              pickle.dumps((Trap(), (), {})))
    tamper(tmp_path / "function")
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv(runner.SECRET_VARIABLE, SECRET.hex())
    with pytest.raises(ValueError, match="fails its signature check"):
        runner._main(folder)
    assert LOADED == [] and not (tmp_path / "result.0").exists()
    (tmp_path / "function").unlink()
    signed_files.write_signed(os.path.join(folder, "function"), SECRET,
                              pickle.dumps((divmod, (7, 2), {})))
    monkeypatch.setenv(runner.SECRET_VARIABLE, SECRET.hex())
    runner._main(folder)
    assert runner.SECRET_VARIABLE not in os.environ  # the function's children do not get it
    assert runner._collect(folder, SECRET, 1, 0, "divmod") == [(3, 1)]


def test_the_caller_unpickles_only_verified_results(tmp_path):
    folder = str(tmp_path)
    signed_files.write_signed(os.path.join(folder, "result.0"), SECRET,
                              pickle.dumps(Outcome(value=Trap())))
    tamper(tmp_path / "result.0")
    with pytest.raises(ValueError, match="fails its signature check"):
        runner._collect(folder, SECRET, 1, 0, "f")
    assert LOADED == []
    (tmp_path / "result.0").unlink()
    signed_files.write_signed(os.path.join(folder, "result.0"), SECRET,
                              pickle.dumps(Outcome(value=Trap())))
    assert runner._collect(folder, SECRET, 1, 0, "f") == [None]
    assert LOADED == ["unpickled"]  # the trap works: the refusals above are real
    LOADED.clear()
