"""The engines' pieces that need no cluster: the argument checks that RayExecutor and
hvd_trainer.spark.run share (each error names the argument), what the MPI launcher passes
the ranks of an engine job (no secret, not the driver's environment), the horovod shim that
an engine rank takes only where no Horovod is installed, and the folders that a killed maker
leaves to the next job's sweep."""
import os
import pathlib
import re
import stat
import subprocess
import sys
import tempfile

import pytest

from hvd_trainer_launch import mpi, protocol
from hvd_trainer_launch.elastic import driver as elastic_driver
from hvd_trainer_launch.engines import (checks as engine_checks, launch as engine_launch,
                                        rank as engine_rank)
from hvd_trainer_launch.files import owned_folders
from hvd_trainer_launch.job import watch as job
from hvd_trainer_launch.rank import horovod_shim

WHERE = "hvd_trainer.spark.run"


@pytest.mark.parametrize("value", [0, -1, "2", 2.5, True, None])
def test_a_count_that_is_not_a_positive_int_is_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"^{WHERE}: num_proc={value!r} must be an int >= 1$"):
        engine_checks.check_count(value, "num_proc", WHERE)


def test_a_positive_count_passes_and_a_function_must_be_callable():
    assert engine_checks.check_count(3, "num_proc", WHERE) == 3
    engine_checks.check_function(len, WHERE)
    with pytest.raises(TypeError, match=rf"{WHERE}: fn=5 is not callable"):
        engine_checks.check_function(5, WHERE)


@pytest.mark.parametrize("env, named", [
    ({"1A": "x"}, "'1A' is not a variable name"),
    ({"A-B": "x"}, "'A-B' is not a variable name"),
    ({"A=B": "x"}, "'A=B' is not a variable name"),
    ({"": "x"}, "'' is not a variable name"),
    ({5: "x"}, "5 is a int, not a str"),
    ({"A": None}, "the value of 'A' is None, a NoneType"),
    ({"A": True}, "the value of 'A' is True, a bool"),
    ({"A": ["x"]}, r"the value of 'A' is \['x'\], a list"),
    ({"A": "a\0b"}, "the value of 'A' holds a NUL character"),
])
def test_an_env_entry_no_environment_can_hold_is_refused_by_name(env, named):
    with pytest.raises(ValueError, match=rf"^{WHERE}: env: {named}"):
        engine_checks.rank_env(env, "env", WHERE)


def test_env_values_become_strings():
    got = engine_checks.rank_env({"A": 3, "B": 0.5, "C": pathlib.Path("/x"), "D": "a=b"}, "env",
                                 WHERE)
    assert got == {"A": "3", "B": "0.5", "C": "/x", "D": "a=b"}
    assert engine_checks.rank_env(None, "env", WHERE) == {}


def test_an_engine_job_passes_the_launcher_only_its_own_variables_and_never_the_secret():
    environ = {"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "s3cr3t",
               protocol.ENGINE_JOB_SECRET_VARIABLE: "ab" * 32,
               protocol.ENGINE_RANK_VARIABLES_VARIABLE: '["OMP_NUM_THREADS"]'}
    engine = job.engine_job(environ)
    assert engine == job.EngineJob("ab" * 32, ("OMP_NUM_THREADS",))
    assert set(environ) == {"PATH", "AWS_SECRET_ACCESS_KEY"}  # taken out: no rank gets them
    own = {protocol.REPORTS_VARIABLE: "h:1", protocol.SECRET_VARIABLE: "ab" * 32,
           protocol.HOSTS_VARIABLE: "[]"}
    forwarded = job.engine_forwarded(engine, own)
    assert protocol.SECRET_VARIABLE not in forwarded and "AWS_SECRET_ACCESS_KEY" not in forwarded
    assert {"OMP_NUM_THREADS", protocol.REPORTS_VARIABLE, protocol.HOSTS_VARIABLE,
            *protocol.NO_FINALIZE_WAIT_VARIABLES} == set(forwarded)
    assert job.engine_job({"PATH": "/bin"}) is None  # a plain hvdrun job


def test_an_engine_jobs_launcher_holds_only_what_it_passes_and_needs():
    # MPICH's mpiexec sends its whole environment to whoever connects to its control port.
    env = {"PATH": "/bin", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HYDRA_IFACE": "eth1",
           protocol.SECRET_VARIABLE: "ab" * 32, "OMP_NUM_THREADS": "1"}
    assert job.launcher_environment(env, None) is env  # a plain job: as it was
    kept = job.launcher_environment(env, ["OMP_NUM_THREADS"])
    assert list(kept) == ["PATH", "HYDRA_IFACE", "OMP_NUM_THREADS", "HVD_LAUNCHER_END"]


def test_the_launcher_passes_only_the_named_variables_under_both_mpis():
    env = {"A": "1", "B": "2", "SECRET": "3"}
    hydra = mpi.build_command(mpi.Launcher("mpiexec", mpi.HYDRA), 2, [], [], ["p"], env,
                              ["A", "B", "MISSING"])
    assert hydra == ["mpiexec", "-n", "2", "-genvlist", "A,B", "p"]
    assert "-genvnone" in mpi.build_command(mpi.Launcher("mpiexec", mpi.HYDRA), 2, [], [],
                                            ["p"], env, [])
    assert "-genvall" in mpi.build_command(mpi.Launcher("mpiexec", mpi.HYDRA), 2, [], [], ["p"],
                                           env)
    openmpi = mpi.build_command(mpi.Launcher("mpirun", mpi.OPENMPI), 2, [], [], ["p"], env,
                                ["A"])
    assert [openmpi[i + 1] for i, word in enumerate(openmpi) if word == "-x"] == ["A"]


def _fake_horovod(folder):
    (folder / "horovod").mkdir()
    (folder / "horovod" / "__init__.py").write_text("")


def test_an_engine_rank_gets_the_shim_last_only_where_no_horovod_is_installed(tmp_path,
                                                                                monkeypatch):
    shim = tmp_path / "shim"
    horovod_shim.write(str(shim))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv(horovod_shim.VARIABLE, raising=False)
    assert engine_rank.offer_horovod_shim(str(shim))
    assert sys.path[-1] == str(shim)
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/elsewhere", str(shim)])
    assert horovod_shim.is_shim(horovod_shim.found())


def test_an_engine_rank_never_shadows_an_installed_horovod_and_obeys_the_switch(tmp_path,
                                                                                 monkeypatch):
    shim, real = tmp_path / "shim", tmp_path / "site"
    horovod_shim.write(str(shim))
    real.mkdir()
    _fake_horovod(real)
    monkeypatch.setattr(sys, "path", [str(real), *sys.path])
    monkeypatch.setenv("PYTHONPATH", "")
    assert not engine_rank.offer_horovod_shim(str(shim))  # Horovod is installed here
    assert str(shim) not in sys.path and os.environ["PYTHONPATH"] == ""
    sys.path.remove(str(real))
    monkeypatch.setenv(horovod_shim.VARIABLE, "0")
    assert not engine_rank.offer_horovod_shim(str(shim))  # turned off
    assert str(shim) not in sys.path


# A maker that ends without removing its folder, as a process that SIGKILL ends.
_MAKER = ("import sys; from hvd_trainer_launch.files import owned_folders; "
          "print(owned_folders.make(sys.argv[1]))")


def test_a_sweep_removes_the_folders_of_makers_that_ended_and_nothing_else(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    prefix = "hvd_test_sweep."
    dead = subprocess.run([sys.executable, "-c", _MAKER, prefix], capture_output=True,
                          text=True, check=True, env=dict(os.environ, TMPDIR=str(tmp_path))
                          ).stdout.strip()
    (pathlib.Path(dead) / "function").write_bytes(b"pickled")
    alive = owned_folders.make(prefix)  # this process's: still running
    assert os.path.dirname(dead) == str(tmp_path) and stat.S_IMODE(os.stat(dead).st_mode) == 0o700
    # A maker that ended, but a folder others may write into, a link, an unnamed maker: kept.
    tag = os.path.basename(dead)[len(prefix):].split(".")[0]
    kept = [os.path.basename(alive), f"{prefix}{tag}.loose", f"{prefix}{tag}.link",
            f"{prefix}unnamed"]
    (tmp_path / kept[1]).mkdir()
    os.chmod(tmp_path / kept[1], 0o755)
    (tmp_path / kept[2]).symlink_to(alive)
    (tmp_path / kept[3]).mkdir(mode=0o700)
    assert owned_folders.sweep(prefix) == [dead]
    assert not os.path.exists(dead)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


# An hvdrun that makes its elastic job's commit folders and ends without removing them.
_HVDRUN = ("from hvd_trainer_launch.elastic import driver; "
           "print(*driver._job_folders())")


def test_an_elastic_jobs_commit_folders_that_its_hvdrun_left_are_swept(tmp_path, monkeypatch):
    # In memory (the /dev/shm stand-in) and on disk, as hvdrun makes them; the next job's
    # sweep, or the engine's after it SIGKILLed its hvdrun, removes them, not a live one's.
    memory, disk = tmp_path / "shm", tmp_path / "tmp"
    memory.mkdir(), disk.mkdir()
    monkeypatch.setattr(protocol, "MEMORY_ROOT", str(memory))
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    code = (f"from hvd_trainer_launch import protocol; protocol.MEMORY_ROOT = {str(memory)!r}; "
            + _HVDRUN)
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=dict(os.environ, TMPDIR=str(disk))).stdout.split()
    assert [os.path.dirname(f) for f in left] == [str(memory), str(disk)]
    assert sorted(elastic_driver.sweep_job_folders()) == sorted(left)
    live = elastic_driver._job_folders()  # this process's job (it sweeps first): running
    assert elastic_driver.sweep_job_folders() == []
    assert os.listdir(memory) + os.listdir(disk) == [os.path.basename(f) for f in live]


def test_a_launch_that_fails_to_start_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def no_process(*args, **kwargs):
        raise OSError("no process today")
    monkeypatch.setattr(engine_launch.subprocess, "Popen", no_process)
    with pytest.raises(OSError, match="no process today"):
        engine_launch.AgentLaunch([("h1", 1)], ["true"], flavour=mpi.HYDRA,
                                  secret=os.urandom(32))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, value", [
    ("elastic_timeout", 600), ("override_discovery", True), ("reset_limit", 2),
    ("cooldown_range", (1, 2))])
def test_ray_executors_elastic_arguments_without_min_workers_are_refused_by_name(name, value):
    # Horovod's elastic arguments mean nothing for a fixed job: they were dropped unread.
    from hvd_trainer_launch.engines.ray_executor import RayExecutor
    with pytest.raises(ValueError, match=rf"^RayExecutor: {re.escape(f'{name}={value!r}')} is for elastic "
                                         r"jobs: give min_workers"):
        RayExecutor(RayExecutor.create_settings(), num_workers=1, **{name: value})


@pytest.mark.parametrize("arguments, named", [
    ({"min_workers": 0}, "min_num_proc=0"), ({"min_workers": 3, "max_workers": 2}, "below"),
    ({"min_workers": 1, "cooldown_range": (5, 1)}, "cooldown_range=")])
def test_ray_executors_elastic_form_refuses_bad_arguments(arguments, named):
    from hvd_trainer_launch.engines.ray_executor import RayExecutor
    with pytest.raises(ValueError, match=named):
        RayExecutor(RayExecutor.create_settings(), **arguments)


def test_elastic_ray_executor_without_a_discovery_is_refused():
    from hvd_trainer_launch.engines.ray_elastic import ElasticRayExecutor
    with pytest.raises(ValueError, match="override_discovery=False needs settings.discovery"):
        ElasticRayExecutor(ElasticRayExecutor.create_settings(), override_discovery=False)


def test_ray_executor_refuses_to_start_inside_a_placement_group(monkeypatch):
    # use_current_placement_group=True (Horovod's default) was accepted and ignored.
    ray = pytest.importorskip("ray")
    import ray.util.placement_group  # noqa: F401 (the module patched below)
    from hvd_trainer_launch.engines.ray_executor import RayExecutor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no Ray instance is started
    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "get_current_placement_group",
                        lambda: object())
    with pytest.raises(ValueError, match=r"inside a Ray placement group.* pass "
                                         r"use_current_placement_group=False"):
        RayExecutor(RayExecutor.create_settings(), num_workers=1).start()
