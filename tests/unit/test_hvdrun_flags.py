"""hvdrun takes every horovodrun 0.28.1 flag: each one is accepted with its effect on the built
mpiexec command line and the ranks' environment, or refused with one line naming it.

These tests build the command without starting MPI: ``run_job`` is replaced by a recorder and
the launcher by a fixed path of each dialect, so every flag is checked under Hydra and Open MPI.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from hvd_trainer_launch import mpi
from hvd_trainer_launch.cli import config_file, hvdrun
from hvd_trainer_launch.job import flags, watch as job
from hvd_trainer_launch.protocol import HOSTS_VARIABLE, REPORTS_VARIABLE, SECRET_VARIABLE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# horovodrun's complete flag list, read from horovod/runner/launch.py of Horovod 0.28.1
# (parse_args): the spellings of each flag and the values it takes.
HOROVODRUN_0_28_1 = [
    (("-v", "--version"), 0),
    (("-np", "--num-proc"), 1),
    (("-cb", "--check-build"), 0),
    (("--disable-cache",), 0),
    (("--start-timeout",), 1),
    (("--network-interfaces",), 1),
    (("--network-interface",), 1),
    (("--output-filename",), 1),
    (("--verbose",), 0),
    (("--config-file",), 1),
    (("-p", "--ssh-port"), 1),
    (("-i", "--ssh-identity-file"), 1),
    (("--fusion-threshold-mb",), 1),
    (("--cycle-time-ms",), 1),
    (("--cache-capacity",), 1),
    (("--hierarchical-allreduce",), 0),
    (("--no-hierarchical-allreduce",), 0),
    (("--hierarchical-allgather",), 0),
    (("--no-hierarchical-allgather",), 0),
    (("--autotune",), 0),
    (("--no-autotune",), 0),
    (("--autotune-log-file",), 1),
    (("--autotune-warmup-samples",), 1),
    (("--autotune-steps-per-sample",), 1),
    (("--autotune-bayes-opt-max-samples",), 1),
    (("--autotune-gaussian-process-noise",), 1),
    (("--min-np", "--min-num-proc"), 1),
    (("--max-np", "--max-num-proc"), 1),
    (("--slots-per-host",), 1),
    (("--elastic-timeout",), 1),
    (("--reset-limit",), 1),
    (("--blacklist-cooldown-range",), 2),
    (("--timeline-filename",), 1),
    (("--timeline-mark-cycles",), 0),
    (("--no-timeline-mark-cycles",), 0),
    (("--no-stall-check",), 0),
    (("--stall-check",), 0),
    (("--stall-check-warning-time-seconds",), 1),
    (("--stall-check-shutdown-time-seconds",), 1),
    (("--mpi-threads-disable",), 0),
    (("--no-mpi-threads-disable",), 0),
    (("--mpi-args",), 1),
    (("--tcp",), 0),
    (("--binding-args",), 1),
    (("--num-nccl-streams",), 1),
    (("--thread-affinity",), 1),
    (("--gloo-timeout-seconds",), 1),
    (("--log-level",), 1),
    (("--log-with-timestamp",), 0),
    (("--log-without-timestamp",), 0),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"), 0),
    (("--log-hide-timestamp",), 0),
    (("--no-log-hide-timestamp",), 0),
    (("-H", "--hosts"), 1),
    (("-hostfile", "--hostfile"), 1),
    (("--host-discovery-script",), 1),
    (("--gloo",), 0),
    (("--mpi",), 0),
    (("--jsrun",), 0),
]

ALL_SPELLINGS = [(name, nargs) for names, nargs in HOROVODRUN_0_28_1 for name in names]
REFUSED = {name for entry in flags.REFUSED for name in entry.names}
SAMPLE = {1: ["7"], 2: ["7", "8"], 0: []}
LAUNCHERS = {mpi.HYDRA: "/opt/mpich/bin/mpiexec", mpi.OPENMPI: "/opt/openmpi/bin/mpirun"}
PROGRAM = ["python", "train.py", "--lr", "0.1"]


def build(monkeypatch, flavour, *options, env=None):
    """Run hvdrun's main with ``options`` (and the variables ``env``) until it would start
    mpiexec; return (the mpiexec command, the variables added to the ranks' environment,
    run_job's arguments)."""
    for name in list(os.environ):
        if name.startswith(("HVD_", "HOROVOD_", "NCCL_", "UCX_", "FI_", "MPI4PY_", "HYDRA_",
                            "I_MPI_", "HVDRUN_", "SLURM_")):
            monkeypatch.delenv(name)
    # hvdrun always sets these two (the finalize waits of MPICH and Open MPI); set beforehand,
    # they are not among the variables the flags add.
    monkeypatch.setenv("MPIR_CVAR_NO_COLLECTIVE_FINALIZE", "1")
    monkeypatch.setenv("OMPI_MCA_async_mpi_finalize", "1")
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    launcher = mpi.Launcher(LAUNCHERS[flavour], flavour)
    monkeypatch.setattr(mpi, "find_launcher", lambda requested=None: launcher)
    seen = {}

    def record(command, ranks_env, relay, np=0, start_timeout=None, ssh=None):
        seen.update(command=command, env=ranks_env, np=np, start_timeout=start_timeout,
                    relay=relay, ssh=ssh)
        return 0

    monkeypatch.setattr(job, "run_job", record)
    assert hvdrun.main(["-np", "2", *options, *PROGRAM]) == 0
    # hvdrun also always sets HVDRUN_HOSTS (test_wrappers_learn_the_nodes_and_their_ranks),
    # and where and how the wrappers report (tests/unit/test_launch_protocol.py).
    # A one-host job's UCX stays on the loopback unless --network-interface says otherwise
    # (test_a_one_host_job_keeps_ucx_on_the_loopback).
    always = (HOSTS_VARIABLE, REPORTS_VARIABLE, SECRET_VARIABLE)
    added = {name: value for name, value in seen["env"].items()
             if os.environ.get(name) != value and name not in always
             and job.LOOPBACK_VARIABLES.get(name) != value}
    return seen["command"], added, seen


def launcher_part(command):
    """The mpiexec arguments between the launcher and hvdrun's rank wrapper, less Open MPI's
    ``-x NAME`` pairs (test_open_mpi_forwards_the_new_variables checks those)."""
    part = command[1:command.index(sys.executable)]
    return [arg for index, arg in enumerate(part)
            if arg != "-x" and (index == 0 or part[index - 1] != "-x")]


def refused_line(capsys, *argv):
    """Run hvdrun with ``argv``; return its stderr, which must be one line, after exit code 2."""
    with pytest.raises(SystemExit) as stop:
        hvdrun.main(list(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err


def test_the_flag_list_is_horovodrun_0_28_1s_and_hvdrun_knows_every_spelling():
    accepted = {name for flag in flags.FLAGS for name in flag.names}
    horovod = {name for name, _ in ALL_SPELLINGS}
    assert len(HOROVODRUN_0_28_1) == 59 and len(horovod) == 69
    assert horovod <= accepted | REFUSED
    assert not accepted & REFUSED
    # hvdrun's own additions: its older stall spellings, two launcher options, --ulfm and
    # --horovod, --elastic-allow-fresh-start.
    assert (accepted | REFUSED) - horovod == {"--stall-check-time-seconds",
                                               "--stall-shutdown-time-seconds", "--mpiexec",
                                               "--no-prefix", "--ulfm", "--horovod",
                                               "--elastic-allow-fresh-start"}


@pytest.mark.parametrize("name, nargs", [spelling for spelling in ALL_SPELLINGS
                                         if spelling[0] in REFUSED])
def test_refused_flag_says_why_in_one_line(capsys, name, nargs):
    err = refused_line(capsys, "-np", "2", name, *SAMPLE[nargs], *PROGRAM)
    assert err.startswith(f"hvdrun: error: {name} is not supported: ")
    reason = err.split("is not supported: ", 1)[1]
    assert len(reason.split()) >= 6  # a reason and what to do, not a bare "unsupported"
    if name.startswith("--autotune"):
        assert "fixed grid" in reason


# For each accepted Horovod flag: the values to give it, the variables it must add to the
# ranks' environment, and the mpiexec arguments it must add under Hydra and under Open MPI.
# Flags whose effect is hvdrun's fixed behaviour ("already so") must change nothing.
NOTHING = ([], {}, [], [])
EFFECTS = {
    "--disable-cache": NOTHING,
    "--hierarchical-allreduce": ([], {"HVD_HIERARCHICAL_ALLREDUCE": "1"}, [], []),
    "--no-hierarchical-allreduce": ([], {"HVD_HIERARCHICAL_ALLREDUCE": "0"}, [], []),
    "--hierarchical-allgather": ([], {"HVD_HIERARCHICAL_ALLGATHER": "1"}, [], []),
    "--no-hierarchical-allgather": ([], {"HVD_HIERARCHICAL_ALLGATHER": "0"}, [], []),
    "--autotune": ([], {"HVD_AUTOTUNE": "1"}, [], []),
    "--no-autotune": ([], {"HVD_AUTOTUNE": "0"}, [], []),
    "--autotune-log-file": (["tune.csv"], {"HVD_AUTOTUNE_LOG": os.path.join(os.getcwd(),
                                                                           "tune.csv")}, [], []),
    "--autotune-warmup-samples": (["2"], {"HVD_AUTOTUNE_WARMUP_SAMPLES": "2"}, [], []),
    "--autotune-steps-per-sample": (["5"], {"HVD_AUTOTUNE_STEPS_PER_SAMPLE": "5"}, [], []),
    "--no-timeline-mark-cycles": NOTHING,
    "--stall-check": NOTHING,
    "--no-mpi-threads-disable": NOTHING,
    "--log-without-timestamp": NOTHING,
    "--log-hide-timestamp": NOTHING,
    "--mpi": NOTHING,
    "--network-interfaces": (["eth0,ib0"], {"NCCL_SOCKET_IFNAME": "eth0,ib0",
                                            "UCX_NET_DEVICES": "eth0,ib0"}, [],
                             ["--mca", "btl_tcp_if_include", "eth0,ib0"]),
    "--network-interface": (["eth1"], {"NCCL_SOCKET_IFNAME": "eth1", "UCX_NET_DEVICES": "eth1"},
                            ["-iface", "eth1"],
                            ["--mca", "btl_tcp_if_include", "eth1"]),
    "-p": (["2222"], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222",
                      "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "-p 2222"}, [],
           ["--mca", "plm_rsh_args", "-p 2222"]),
    "--ssh-port": (["2222"], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-p 2222",
                              "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "-p 2222"}, [],
                   ["--mca", "plm_rsh_args", "-p 2222"]),
    "-i": (["/keys/id rsa"], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-i '/keys/id rsa'",
                              "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "-i '/keys/id rsa'"}, [],
           ["--mca", "plm_rsh_args", "-i '/keys/id rsa'"]),
    "--ssh-identity-file": (["/keys/id"], {"HYDRA_LAUNCHER_EXTRA_ARGS": "-i /keys/id",
                                           "I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS": "-i /keys/id"},
                            [], ["--mca", "plm_rsh_args", "-i /keys/id"]),
    "--fusion-threshold-mb": (["32"], {"HVD_FUSION_THRESHOLD": str(32 * 1024 * 1024)}, [], []),
    "--timeline-filename": (["trace.json"], {"HVD_TIMELINE": os.path.join(os.getcwd(), "trace.json")},
                            [], []),
    "--no-stall-check": ([], {"HVD_STALL_CHECK_TIME_SECONDS": "0",
                              "HVD_STALL_SHUTDOWN_TIME_SECONDS": "0"}, [], []),
    "--stall-check-warning-time-seconds": (["30"], {"HVD_STALL_CHECK_TIME_SECONDS": "30"}, [], []),
    "--stall-check-shutdown-time-seconds": (["120"], {"HVD_STALL_SHUTDOWN_TIME_SECONDS": "120"},
                                            [], []),
    "--mpi-threads-disable": ([], {"MPI4PY_RC_THREAD_LEVEL": "single"}, [], []),
    "--mpi-args": (["-l --foo 'a b'"], {}, ["-l", "--foo", "a b"], ["-l", "--foo", "a b"]),
    "--tcp": ([], {"NCCL_IB_DISABLE": "1", "UCX_TLS": "tcp,self,sm", "FI_PROVIDER": "tcp"}, [], []),
    "--binding-args": (["-bind-to core"], {}, ["-bind-to", "core"], ["-bind-to", "core"]),
    "--log-level": (["WARNING"], {"HVD_LOG_LEVEL": "warning"}, [], []),
    "-prefix-timestamp": ([], {"HVDRUN_TIMESTAMP": "1"}, [], []),
    "--prefix-output-with-timestamp": ([], {"HVDRUN_TIMESTAMP": "1"}, [], []),
    "-H": (["a:2,b:1"], {}, ["-hosts", "a:2,b:1"], ["-H", "a:2,b:1"]),
    "--hosts": (["a:2"], {}, ["-hosts", "a:2"], ["-H", "a:2"]),
    "--verbose": ([], {"HVD_LOG_LEVEL": "debug"}, [], []),
    "--start-timeout": (["45"], {}, [], []),
}
# Flags checked by their own tests below: -v/--version, -np/--num-proc, -cb/--check-build,
# --output-filename, --config-file, -hostfile/--hostfile, --start-timeout's ending of the job;
# the elastic flags in tests/parallel/test_elastic.py and tests/unit/test_elastic_launch.py.
OWN_TESTS = {"-v", "--version", "-np", "--num-proc", "-cb", "--check-build", "--output-filename",
             "--config-file", "-hostfile", "--hostfile", "--min-np", "--min-num-proc", "--max-np",
             "--max-num-proc", "--host-discovery-script", "--slots-per-host", "--elastic-timeout",
             "--reset-limit", "--blacklist-cooldown-range"}


def test_every_accepted_horovod_flag_has_its_effect_checked():
    accepted = {name for name, _ in ALL_SPELLINGS if name not in REFUSED}
    assert accepted == set(EFFECTS) | OWN_TESTS


@pytest.mark.parametrize("flavour", [mpi.HYDRA, mpi.OPENMPI])
@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_accepted_flag_sets_its_variables_and_mpiexec_arguments(monkeypatch, flavour, name):
    values, variables, hydra_args, openmpi_args = EFFECTS[name]
    base_command, base_env, _ = build(monkeypatch, flavour)
    command, env, _ = build(monkeypatch, flavour, name, *values)
    if flavour == mpi.OPENMPI:  # Hydra reads the ssh options from its environment, Open MPI not
        variables = {key: value for key, value in variables.items() if "EXTRA_ARGS" not in key}
    assert {key: value for key, value in env.items() if base_env.get(key) != value} == variables
    extra = launcher_part(command)
    for argument in launcher_part(base_command):
        extra.remove(argument)
    assert extra == (hydra_args if flavour == mpi.HYDRA else openmpi_args)
    assert command[-len(PROGRAM):] == PROGRAM


@pytest.mark.parametrize("flavour, options, nodes", [
    (mpi.HYDRA, [], [["localhost", 2]]),  # no hosts: every rank here, as horovodrun's default
    (mpi.HYDRA, ["-H", "a:1,b:4"], [["a", 1], ["b", 1]]),
    (mpi.HYDRA, ["-H", "localhost:1,127.0.0.1:1"], [["localhost", 1], ["127.0.0.1", 1]]),
    # Open MPI makes one node of one machine's names; Hydra one of each entry.
    (mpi.OPENMPI, ["-H", "localhost:1,127.0.0.1:1"], [["localhost", 2]]),
    (mpi.OPENMPI, ["-H", "a:1,b:1,a:1"], [["a", 2]]),
    (mpi.HYDRA, ["-H", "a:1,b:1,a:1"], [["a", 1], ["b", 1]]),
])
def test_wrappers_learn_the_nodes_and_their_ranks(monkeypatch, flavour, options, nodes):
    _, _, seen = build(monkeypatch, flavour, *options)
    assert json.loads(seen["env"][HOSTS_VARIABLE]) == nodes


def test_more_ranks_than_slots_is_refused_as_in_horovodrun(capsys):
    with pytest.raises(SystemExit) as stop:
        hvdrun.main(["-np", "3", "-H", "a:1,b:1", *PROGRAM])
    assert stop.value.code == 2
    assert ("error: -np 3 is more than the 2 slots of the hosts given (a:1,b:1); give more "
            "slots (host:N) or a smaller -np") in capsys.readouterr().err


def test_start_timeout_reaches_the_job(monkeypatch):
    _, _, seen = build(monkeypatch, mpi.HYDRA, "--start-timeout", "45")
    assert seen["start_timeout"] == 45 and seen["np"] == 2
    _, _, seen = build(monkeypatch, mpi.HYDRA)
    assert seen["start_timeout"] is None
    _, _, seen = build(monkeypatch, mpi.HYDRA, env={"HOROVOD_START_TIMEOUT": "30"})
    assert seen["start_timeout"] == 30
    _, _, seen = build(monkeypatch, mpi.HYDRA, "--start-timeout", "45",
                       env={"HOROVOD_START_TIMEOUT": "30"})
    assert seen["start_timeout"] == 45


def test_old_stall_spellings_still_work(monkeypatch):
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--stall-check-time-seconds", "30",
                      "--stall-shutdown-time-seconds", "120")
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "30"
    assert env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] == "120"


def test_unambiguous_prefixes_work_as_in_horovodrun(monkeypatch, capsys):
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--fusion-threshold", "2", "--stall-check-w", "9")
    assert env["HVD_FUSION_THRESHOLD"] == str(2 << 20)
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "9"
    err = refused_line(capsys, "-np", "2", "--cycle-time", "5", *PROGRAM)
    assert err.startswith("hvdrun: error: --cycle-time-ms is not supported")


def test_no_stall_check_wins_over_the_times_as_in_horovod(monkeypatch):
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--stall-check-warning-time-seconds", "30",
                      "--no-stall-check")
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "0"
    assert env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] == "0"


@pytest.mark.parametrize("level, expected", [("TRACE", "debug"), ("debug", "debug"),
                                             ("INFO", "info"), ("ERROR", "error"),
                                             ("FATAL", "critical")])
def test_log_levels_map_onto_hvd_trainers_logger(monkeypatch, level, expected):
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--log-level", level, "--verbose")
    assert env["HVD_LOG_LEVEL"] == expected


def test_repeated_network_interface_collects_every_nic(monkeypatch):
    command, env, _ = build(monkeypatch, mpi.OPENMPI, "--network-interface", "eth0",
                            "--network-interface", "eth1,eth0")
    assert env["NCCL_SOCKET_IFNAME"] == "eth0,eth1"
    assert "eth0,eth1" in command


@pytest.mark.parametrize("given", [["--mpi-args", "--map-by node"],
                                   ["--binding-args", "-bind-to core -map-by socket"],
                                   ["--mpi-args=--map-by=ppr:1:node"]])
def test_open_mpi_maps_by_slot_unless_the_arguments_map(monkeypatch, given):
    # By slot, Open MPI fills each host's slots in turn, as Hydra does; its --oversubscribe
    # alone mapped by core and put every rank on the first host. A mapping of the user's
    # replaces hvdrun's (Open MPI refuses two).
    command, _, _ = build(monkeypatch, mpi.OPENMPI, "-H", "a:2,b:2")
    assert command[3:5] == ["--map-by", "slot:OVERSUBSCRIBE"] and "--oversubscribe" not in command
    command, _, _ = build(monkeypatch, mpi.OPENMPI, *given)
    assert "slot:OVERSUBSCRIBE" not in command
    assert sum(arg.lstrip("-").startswith("map-by") for arg in command) == 1


def test_open_mpi_forwards_the_new_variables(monkeypatch):
    command, _, _ = build(monkeypatch, mpi.OPENMPI, "--tcp")
    for name in ("NCCL_IB_DISABLE", "UCX_TLS", "FI_PROVIDER", REPORTS_VARIABLE, SECRET_VARIABLE):
        assert command[command.index(name) - 1] == "-x"


def test_version_prints_the_installed_version(capsys):
    with open(os.path.join(REPO, "hvd_trainer", "__init__.py")) as init:
        version = re.search(r'^__version__ = "([^"]+)"$', init.read(), re.M)[1]
    for spelling in ("-v", "--version"):
        with pytest.raises(SystemExit) as stop:
            hvdrun.main([spelling])
        assert stop.value.code == 0
        assert capsys.readouterr().out == f"hvdrun (hvd_trainer) {version}\n"


@pytest.mark.parametrize("spelling", ["-np", "--num-proc"])
def test_num_proc_is_mpiexecs_rank_count(monkeypatch, spelling):
    monkeypatch.setattr(mpi, "find_launcher", lambda requested=None: mpi.Launcher("/x/mpiexec", mpi.HYDRA))
    seen = {}
    monkeypatch.setattr(job, "run_job",
                        lambda command, *rest, **named: seen.update(command=command) or 0)
    assert hvdrun.main([spelling, "3", *PROGRAM]) == 0
    assert seen["command"][1:3] == ["-n", "3"]


@pytest.mark.parametrize("spelling", ["-cb", "--check-build"])
def test_check_build_runs_without_np(monkeypatch, spelling):
    from hvd_trainer_launch.cli import check_build
    calls = []
    monkeypatch.setattr(check_build, "check_build", lambda requested: calls.append(requested) or 0)
    assert hvdrun.main([spelling]) == 0
    assert calls == [None]


@pytest.mark.parametrize("spelling", ["-hostfile", "--hostfile"])
def test_hostfile_spellings(monkeypatch, tmp_path, spelling):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2:1\n")
    command, _, _ = build(monkeypatch, mpi.HYDRA, spelling, str(hostfile))
    assert command[command.index("-hosts") + 1] == "node1:2,node2:1"


def test_output_filename_creates_per_rank_files(monkeypatch, tmp_path):
    _, _, seen = build(monkeypatch, mpi.HYDRA, "--output-filename", str(tmp_path / "logs"))
    seen["relay"].close()
    assert sorted(os.listdir(tmp_path / "logs")) == ["rank.0", "rank.1"]
    assert sorted(os.listdir(tmp_path / "logs" / "rank.1")) == ["stderr", "stdout"]


HOROVOD_CONFIG = """\
# the layout of Horovod's config files
controller: mpi

params:
  fusion_threshold_mb: 32
  hierarchical_allreduce: false   # stays flat

timeline:
  filename: 'timeline #1.json'

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true

logging:
  level: INFO
  with_timestamp: false
"""


def test_config_file_settings_act_as_their_flags(monkeypatch, tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(HOROVOD_CONFIG)
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--config-file", str(config))
    assert env == {"HVD_FUSION_THRESHOLD": str(32 << 20), "HVD_HIERARCHICAL_ALLREDUCE": "0",
                   "HVD_TIMELINE": os.path.join(os.getcwd(), "timeline #1.json"),
                   "HVD_STALL_CHECK_TIME_SECONDS": "120",
                   "HVD_STALL_SHUTDOWN_TIME_SECONDS": "240",
                   "MPI4PY_RC_THREAD_LEVEL": "single",
                   "HVD_LOG_LEVEL": "info"}


def test_command_line_wins_over_config_file_wherever_it_stands(monkeypatch, tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text(HOROVOD_CONFIG + "\n")
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--fusion-threshold-mb", "8", "--config-file",
                      str(config), "--no-mpi-threads-disable", "--stall-check-time-seconds", "5")
    assert env["HVD_FUSION_THRESHOLD"] == str(8 << 20)
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "5"
    assert "MPI4PY_RC_THREAD_LEVEL" not in env
    assert env["HVD_STALL_SHUTDOWN_TIME_SECONDS"] == "240"


def test_config_disabling_the_stall_check(monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("stall_check:\n  enabled: false\n  warning_time_seconds: 60\n")
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--config-file", str(config))
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "0"
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--config-file", str(config), "--stall-check")
    assert env["HVD_STALL_CHECK_TIME_SECONDS"] == "60"


def test_config_autotune_section_acts_as_its_flags(monkeypatch, capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("autotune:\n  enabled: true\n  log_file: tune.csv\n"
                      "  warmup_samples: 2\n  steps_per_sample: 4\n")
    _, env, _ = build(monkeypatch, mpi.HYDRA, "--config-file", str(config))
    assert env == {"HVD_AUTOTUNE": "1", "HVD_AUTOTUNE_LOG": os.path.join(os.getcwd(), "tune.csv"),
                   "HVD_AUTOTUNE_WARMUP_SAMPLES": "2", "HVD_AUTOTUNE_STEPS_PER_SAMPLE": "4"}
    config.write_text("autotune:\n  enabled: true\n  bayes_opt_max_samples: 20\n")
    err = refused_line(capsys, "--config-file", str(config), "-np", "2", *PROGRAM)
    assert "--autotune-bayes-opt-max-samples is not supported" in err and "fixed grid" in err


def test_refused_config_setting_names_setting_and_flag(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("controller: gloo\n")
    err = refused_line(capsys, "--config-file", str(config), "-np", "2", *PROGRAM)
    assert err.startswith("hvdrun: error: --gloo is not supported: ")
    assert err.rstrip().endswith(f"(controller in {config})")
    config.write_text("params:\n  cycle_time_ms: 5\n")
    err = refused_line(capsys, "--config-file", str(config), "-np", "2", *PROGRAM)
    assert "--cycle-time-ms is not supported" in err and "params.cycle_time_ms" in err


def test_refused_config_setting_overridden_on_the_command_line_is_fine(monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("timeline:\n  mark_cycles: true\n")
    build(monkeypatch, mpi.HYDRA, "--config-file", str(config), "--no-timeline-mark-cycles")


@pytest.mark.parametrize("text, message", [
    ("params:\n  fusion_threshold_mb: [1, 2]\n", "c.yaml:2"),
    ("params:\n  nested:\n    deeper: 1\n", "c.yaml:2"),
    ("params:\n  no_such_knob: 1\n", "params.no_such_knob is not a setting"),
    ("params:\n  hierarchical_allreduce: maybe\n", "is not true or false"),
    ("controller: jsrun\n", "is not mpi or gloo"),
])
def test_bad_config_file_is_one_clear_line(capsys, tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    err = refused_line(capsys, "--config-file", str(config), "-np", "2", *PROGRAM)
    assert err.startswith("hvdrun: error: --config-file: ") and message in err


def test_config_scalars_follow_yaml():
    assert config_file._scalar("'a # b'", "f", 1) == "a # b"
    assert config_file._scalar("-3", "f", 1) == -3
    assert config_file._scalar("0.5", "f", 1) == 0.5
    assert config_file._scalar("Yes", "f", 1) is True
    assert config_file._scalar("~", "f", 1) is None
    assert config_file._scalar("eth0", "f", 1) == "eth0"


@pytest.mark.parametrize("argv, message", [
    (["--binding-args", "'unclosed"], "--binding-args"),
    (["--start-timeout", "0"], "--start-timeout (or HVD_START_TIMEOUT) must be > 0"),
    (["--stall-check-time-seconds", "-1"], "--stall-check-warning-time-seconds must be >= 0"),
    (["--log-level", "LOUD"], "--log-level"),
])
def test_bad_flag_values_are_errors(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(mpi, "find_launcher", lambda requested=None: mpi.Launcher("/x/mpiexec", mpi.HYDRA))
    with pytest.raises(SystemExit) as stop:
        hvdrun.main(["-np", "2", *argv, *PROGRAM])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_start_timeout_ends_a_job_whose_ranks_never_start(tmp_path):
    # An "mpiexec" that never starts a rank: hvdrun must end it once the timeout has passed.
    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "HYDRA build details"; exit 0; }\n'
                    "exec sleep 60\n")
    fake.chmod(0o755)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "hvd_trainer_launch.cli.hvdrun", "--mpiexec", str(fake),
                             "--start-timeout", "1", "-np", "2", *PROGRAM],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - start < 30
    assert "hvdrun: ranks 0, 1 did not start within --start-timeout 1 s; ending the job" in result.stderr


def _docs_flag_rows():
    """docs/configuration.md's flag table as the docs build generates it: (spellings, effect)."""
    path = os.path.join(REPO, "docs", "hooks", "generate.py")
    spec = importlib.util.spec_from_file_location("docs_generate", path)
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    rows = []
    for row in generate.flags_table().splitlines()[2:]:
        first, effect = row.strip("|").split(" | ", 1)
        rows.append((re.findall(r"`(-[^` ]+)", first), effect.strip()))
    return rows


def test_the_docs_flag_table_names_every_option_hvdrun_accepts_with_its_help():
    # The reference is the parser hvdrun runs: every option string it takes has a row, and an
    # accepted flag's row says what `hvdrun --help` says.
    parser = hvdrun.build_parser()
    accepted = {option: action for action in parser._actions for option in action.option_strings
                if option not in ("-h", "--help")}
    rows = _docs_flag_rows()
    assert sorted(name for names, _ in rows for name in names) == sorted(accepted)
    for names, effect in rows:
        help_text = accepted[names[0]].help
        if help_text == argparse.SUPPRESS:
            assert effect.startswith("refused: ")
        else:
            assert effect == help_text.replace("%%", "%"), names


def test_the_docs_give_each_refused_flag_the_reason_hvdrun_prints(capsys):
    for names, effect in _docs_flag_rows():
        if not effect.startswith("refused: "):
            continue
        with pytest.raises(SystemExit):
            hvdrun.main([names[0], "1", "-np", "2", *PROGRAM])
        assert capsys.readouterr().err.strip() == \
            f"hvdrun: error: {names[0]} is not supported: {effect[len('refused: '):]}"


def test_slurm_allocations_node_list_and_tasks_give_the_hosts():
    assert mpi.slurm_allocation({"SLURM_JOB_NODELIST": "node[01-03,07],gpu1",
                                 "SLURM_TASKS_PER_NODE": "2(x3),1,4"}) == \
        [("node01", 2), ("node02", 2), ("node03", 2), ("node07", 1), ("gpu1", 4)]
    assert mpi.slurm_allocation({"SLURM_JOB_NODELIST": "x[8-10]y",
                                 "SLURM_TASKS_PER_NODE": "1(x3)"}) == \
        [("x8y", 1), ("x9y", 1), ("x10y", 1)]
    assert mpi.slurm_allocation({}) == []
    with pytest.raises(ValueError, match="names 2 nodes but SLURM_TASKS_PER_NODE='2' 1"):
        mpi.slurm_allocation({"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2"})
    with pytest.raises(ValueError, match="cannot read 'r\\[1-2\\]n\\[1-2\\]'"):
        mpi.slurm_allocation({"SLURM_JOB_NODELIST": "r[1-2]n[1-2]",
                              "SLURM_TASKS_PER_NODE": "1(x4)"})


def test_inside_a_slurm_allocation_the_horovod_variables_follow_its_nodes(monkeypatch):
    # mpiexec places the ranks on the allocation's nodes by itself (no hosts on its command
    # line); the ranks' wrappers learn that placement from hvdrun.
    allocation = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    command, _, seen = build(monkeypatch, mpi.HYDRA, "-np", "4", env=allocation)
    assert "-hosts" not in command
    assert json.loads(seen["env"][HOSTS_VARIABLE]) == [["n1", 2], ["n2", 2]]


def test_a_one_host_job_keeps_ucx_on_the_loopback(monkeypatch):
    _, _, seen = build(monkeypatch, mpi.HYDRA)
    assert seen["env"]["UCX_NET_DEVICES"] == "lo"
    _, _, seen = build(monkeypatch, mpi.HYDRA, "--network-interface", "eth1")
    assert seen["env"]["UCX_NET_DEVICES"] == "eth1"
    _, _, seen = build(monkeypatch, mpi.HYDRA, env={"UCX_NET_DEVICES": "mlx5_0:1"})
    assert seen["env"]["UCX_NET_DEVICES"] == "mlx5_0:1"
    _, _, seen = build(monkeypatch, mpi.HYDRA, "-H", "h1:1,h2:1")
    assert "UCX_NET_DEVICES" not in seen["env"]


@pytest.mark.parametrize("variable", ["HVD_START_TIMEOUT", "HOROVOD_START_TIMEOUT"])
def test_a_start_timeout_of_nan_is_refused_naming_the_variable(monkeypatch, capsys, variable):
    monkeypatch.setattr(mpi, "find_launcher", lambda requested=None: mpi.Launcher("/x/mpiexec", mpi.HYDRA))
    monkeypatch.delenv("HVD_START_TIMEOUT", raising=False)
    monkeypatch.setenv(variable, "nan")
    with pytest.raises(SystemExit) as stop:
        hvdrun.main(["-np", "2", *PROGRAM])
    assert stop.value.code == 2
    assert f"{variable}='nan' is not a number of seconds (nan)" in capsys.readouterr().err


def test_open_mpi_hostfile_lines_with_max_slots_are_read(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=4 max_slots=8\nnode2 max_slots=2\nnode3:2\nnode4 slots=1\n")
    assert mpi.read_hostfile(str(hostfile)) == [("node1", 4), ("node2", 1), ("node3", 2),
                                                ("node4", 1)]


@pytest.mark.parametrize("content, message", [
    (b"\x7fELF\x02\x01\x01\x00\xff\xfe", "is not a text file (byte 8 is not UTF-8)"),
    (b"node1 slots=2\nnode2 slots=4 max_slots=3\n", "line 2: bad host entry"),
    (b"node1 cpus=2\n", "line 1: bad host entry 'node1 cpus=2'"),
])
def test_a_bad_hostfile_is_refused_naming_the_file(tmp_path, content, message):
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"hostfile {str(hostfile)!r}")) as found:
        mpi.read_hostfile(str(hostfile))
    assert message in str(found.value)


def test_a_plain_job_says_it_reaches_hosts_by_ssh_on_the_port_given(monkeypatch):
    # After a failed launch hvdrun looks into the hosts ssh could not reach (job/unreached.py)
    # on -p's port; not inside a Slurm allocation, where srun starts the ranks.
    assert build(monkeypatch, mpi.HYDRA, "-p", "2222")[2]["ssh"] == job.SshLaunch(2222)
    assert build(monkeypatch, mpi.HYDRA)[2]["ssh"] == job.SshLaunch(None)
    assert build(monkeypatch, mpi.HYDRA, env={"SLURM_JOB_ID": "7"})[2]["ssh"] is None
