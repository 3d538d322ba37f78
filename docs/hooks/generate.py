"""Build-time tables of the docs, generated from the code so that they cannot drift from it.

mkdocs runs this file as a hook (mkdocs.yml, ``hooks:``). Before a page is converted, each
marker comment in its Markdown is replaced:

- ``<!-- generated: hvdrun-flags -->``: hvdrun's flags, from ``hvd_trainer_launch/job/flags.py`` (FLAGS and
  REFUSED, the tables hvdrun's parser is built from);
- ``<!-- generated: settings -->``: the variables a user may set, their defaults taken from
  ``hvd_trainer/runtime/config.py`` (AGREED_SETTINGS, OWN_SETTINGS) where the code has a table;
- ``<!-- generated: hvdrun-variables -->``: the variables hvdrun and its wrappers set;
- ``<!-- api: MODULE -->``: the mkdocstrings directive for MODULE's public names, read from
  its source by griffe (no framework is imported).

After conversion, the docstrings' Sphinx roles (``:func:`name```) lose their role prefix, so
the name shows as code.

Only the meaning of each variable is written here (the code has no words for it); which
variables exist is found in the source (string literals ``"HVD_..."``/``"HVDRUN_..."`` and
``env("...")`` calls), and a variable found there without a meaning here, or described here
but gone from the code, fails the build.
"""
import functools
import os
import re
import sys
from typing import Dict, Iterable, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # so that the build reads this checkout's code, installed or not
    sys.path.insert(0, REPO)

# What each variable a user may set does; the default comes from the code where it has one.
SETTINGS: Dict[str, str] = {
    "HVD_FUSION_THRESHOLD": "largest fused bucket of `grouped_allreduce`, bytes",
    "HVD_BUCKET_THRESHOLD": "largest gradient bucket of the trainers' reducer, bytes",
    "HVD_OVERLAP": "1: reduce gradient buckets on a communication thread while backward runs, "
                   "updating each bucket as it arrives (MXNet; the PyTorch optimizer always "
                   "overlaps)",
    "HVD_AUTOTUNE": "1: the first steps try bucket thresholds and overlap; every rank keeps "
                    "rank 0's fastest (see [Concepts](concepts.md#autotune))",
    "HVD_AUTOTUNE_LOG": "CSV file that rank 0 appends each autotune sample and the choice to",
    "HVD_AUTOTUNE_WARMUP_SAMPLES": "samples of the configured setting run first and not counted",
    "HVD_AUTOTUNE_STEPS_PER_SAMPLE": "steps per autotune sample (at least 2: a sample is timed "
                                     "between its steps' launches)",
    "HVD_ALLREDUCE_ALGO": "`ring`, `native` (`MPI_Allreduce`), or `auto` (a host allreduce "
                          "small enough for the agreement's carrier gathers it, then native below "
                          "`HVD_RING_THRESHOLD`, the ring above it)",
    "HVD_RING_THRESHOLD": "`auto` uses native below it and the ring from it on, bytes",
    "HVD_HIERARCHICAL_ALLREDUCE": "1: the world's host allreduce reduces within each host, "
                                  "allreduces among one rank per host, broadcasts within the "
                                  "host ([Performance](performance.md#hierarchical-allreduce))",
    "HVD_HIERARCHICAL_ALLGATHER": "1: the world's host allgather gathers within each host, "
                                  "allgathers among one rank per host, broadcasts within the "
                                  "host",
    "HVD_GPU_COMMUNICATOR": "GPU collectives: `nccl`, `mpi` (host-staged), or `auto` (NCCL "
                            "where every rank has its own GPU)",
    "HVD_STALL_CHECK_TIME_SECONDS": "warn, naming the missing ranks, after waiting this long "
                                    "(0: never)",
    "HVD_STALL_SHUTDOWN_TIME_SECONDS": "end the job after waiting this long (0: never)",
    "HVD_TIMELINE": "write a Chrome trace (Perfetto, chrome://tracing) from rank 0 to this file",
    "HVD_LOG_LEVEL": "`debug`, `info`, `warning`, `error` for the `hvd_trainer` logger",
    "HVD_BACKEND": "`mpi` or `local`, to override launcher detection (`local` also skips the "
                   "wrong-launcher check)",
    "HVD_MPIEXEC": "hvdrun's launcher, as `--mpiexec` (default: the one of mpi4py's MPI)",
    "HVD_START_TIMEOUT": "hvdrun's `--start-timeout` when the flag is not given",
}
# Defaults of the variables that the code reads without a table of defaults.
OTHER_DEFAULTS: Dict[str, str] = {
    "HVD_TIMELINE": "unset", "HVD_LOG_LEVEL": "unset (warnings)", "HVD_BACKEND": "detected",
    "HVD_MPIEXEC": "unset", "HVD_START_TIMEOUT": "unset (no limit)",
}
# Variables that hvdrun, its rank wrappers or hvd_trainer.run set; not for users to set.
SET_BY_HVDRUN: Dict[str, str] = {
    "HVD_LAUNCHED": "tells `init` that a launcher started this process",
    "HVD_JOB_SECRET": "the job's 32 random bytes; the wrappers' reports, elastic commits and "
                      "the notice port's answers are signed with it ([Security](security.md))",
    "HVD_RUN_SECRET": "`hvd_trainer.run`'s key, which signs the function and the results",
    "HVD_ENGINE_FOLDER": "an engine job's folder on one host, private to its agent, where the "
                         "ranks find the function and leave their results "
                         "([Running on Spark](spark.md), [Running on Ray](ray.md))",
    "HVD_ENGINE_SECRET": "an engine job's key, which signs the files in `HVD_ENGINE_FOLDER`",
    "HVD_ENGINE_WORKDIR": "the working folder of an engine job's agent, where its ranks work",
    "HVD_ENGINE_REGISTRY": "host:port of a Spark job's registry on the driver, where each "
                           "rank says that it runs the function ([Running on Spark]"
                           "(spark.md#how-it-works))",
    "HVD_SPARK_TASK_RESOURCES": "the resources Spark assigned to the tasks on a rank's host, by "
                                "local rank, for `hvd_trainer.spark.task.get_available_devices`",
    "HVD_ENGINE_LAUNCH_SECRET": "an engine launch's key under Open MPI, which signs the proxy "
                                "commands that its launcher agent (`engine_ssh`) hands over",
    "HVD_ENGINE_LIVES": "\"1\" in an elastic engine job's hvdrun: it prints each life's hosts "
                        "(and those a growth in place adds) for the engine launch, and "
                        "leaves the other hosts' commit folders to the agents ([Running on "
                        "Ray](ray.md#elastic-jobs))",
    "HVD_ENGINE_LOST": "the file where an elastic engine job's driver lists the agents it "
                       "lost, by life, which its hvdrun reads: that life ends at once, or "
                       "under `--ulfm` the others go on ([Elastic](elastic.md#on-ray))",
    "HVD_ENGINE_AGENT": "the engine agent that started a rank's MPI proxy (its pid and start "
                        "time): the rank's wrapper ends the rank when that agent is gone",
    "HVD_ELASTIC_IN_PLACE": "`0` in hvdrun's environment: hosts added to or removed from an "
                            "elastic job restart every rank instead of changing the job in "
                            "place ([Elastic](elastic.md#how-it-works))",
    "HVD_ELASTIC_LEFT": "`1` in the environment of a rank that an elastic job left out in "
                        "place (a removal), set as it exits: an engine job's rank then says it "
                        "left instead of returning a result ([Elastic](elastic.md#how-it-works))",
    "HVD_ELASTIC_ULFM": "`1` on the driver of an elastic Ray or Spark job (`ulfm=None`): it "
                        "runs under hvdrun's `--ulfm`, Open MPI 5 ([Running on Ray]"
                        "(ray.md#elastic-jobs), [Running on Spark](spark.md#elastic))",
    "HVD_ENGINE_EVENTS": "the file, in its agent's folder, where a rank of an elastic Ray job "
                         "appends what `ray_logger.log` logs, for the driver's callbacks",
    "HVD_ENGINE_COMMITS": "an elastic engine job's commit folder on one host, its agent's "
                          "across lives, which stands in for `HVD_ELASTIC_DIR` on its ranks",
    "HVD_ENGINE_JOB_SECRET": "an engine launch's `HVD_JOB_SECRET` for hvdrun, which the agents "
                             "hand the ranks: it never travels through the MPI launcher "
                             "([Security](security.md#the-mpi-launchers-control-port))",
    "HVD_LAUNCHER_END": "the last variable of an engine job's `mpiexec` environment: MPICH "
                        "5.0.2's proxies never pass the ranks the last one that `-genvlist` "
                        "names",
    "HVD_ENGINE_RANK_VARIABLES": "the names of an engine job's variables for the ranks (`env`, "
                                 "`extra_env_vars`), which with hvdrun's own are all that the "
                                 "MPI launcher passes them",
    "HVD_ELASTIC_DIR": "the job's folder for elastic commits on each host's local disk",
    "HVD_ELASTIC_RESTART": "how many times the elastic job was restarted before this life",
    "HVD_ELASTIC_NOTIFY": "host:port where hvdrun tells the hosts' generation",
    "HVD_ELASTIC_GENERATION": "the hosts' generation this life started with",
    "HVD_ELASTIC_DISK_DIR": "the job's folder on disk for elastic commits that memory cannot "
                            "hold (its own random name)",
    "HVD_ELASTIC_COMMITTED": "the newest commit rank 0 told hvdrun it had written; a restart "
                             "that finds none after one was written fails",
    "HVD_ELASTIC_ALLOW_FRESH_START": "set by `--elastic-allow-fresh-start` (or `1` by hand): a "
                                     "restart that finds no commit trains again from the start",
    "HVD_ULFM": "set by `--ulfm`: the survivors of a killed rank shrink the job and go on",
    "HVD_ELASTIC_MIN_NP": "`--min-np`, with `--ulfm`: fewer survivors end the life instead",
    "HVD_HOROVOD_SHIM": "set by `--horovod`: each rank's wrapper puts a `horovod` shim first "
                        "on the rank's `PYTHONPATH` ([hvdrun](hvdrun.md#horovod)); `0` in an "
                        "engine job's `env` turns off the shim its ranks get "
                        "([Running on Ray](ray.md#functions-written-for-horovod))",
    "HVDRUN_WORKER": "marks a rank started by hvdrun's wrapper",
    "HVDRUN_HOSTS": "the hosts and slots, for the wrapper's `HOROVOD_*` variables",
    "HVDRUN_TIMESTAMP": "set by `--prefix-output-with-timestamp`",
    "HVDRUN_REPORTS": "host:port of hvdrun's report port, where each rank's wrapper reports "
                      "its start and a failed exit (signed with `HVD_JOB_SECRET`)",
}

_LITERAL = re.compile(r"[\"']((?:HVD|HVDRUN)_[A-Z0-9_]+)[\"']")
_ENV_CALL = re.compile(r"\benv\(\s*[\"']([A-Z0-9_]+)[\"']")


def _sources() -> Iterable[str]:
    for top in ("hvd_trainer", "hvd_trainer_launch"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        yield f.read()


def variables_in_code() -> List[str]:
    """Every HVD_*/HVDRUN_* variable the package or hvdrun names, and every setting it reads."""
    from hvd_trainer.runtime import config
    found = {"HVD_" + name for name in {**config.AGREED_SETTINGS, **config.OWN_SETTINGS}}
    for source in _sources():
        found.update(_LITERAL.findall(source))
        found.update("HVD_" + name for name in _ENV_CALL.findall(source))
    return sorted(found)


def check_variables() -> None:
    """Raise naming each variable that the code has and the docs do not describe, or back."""
    in_code = set(variables_in_code())
    described = set(SETTINGS) | set(SET_BY_HVDRUN)
    missing, stale = sorted(in_code - described), sorted(described - in_code)
    if missing or stale:
        raise ValueError(f"docs/hooks/generate.py: describe {missing} (found in the code) and "
                         f"drop {stale} (no longer in the code)")


def _default(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value == "":
        return "unset"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return f"`{value}`" if isinstance(value, str) else str(value)


def settings_table() -> str:
    """The user's variables: name, default, whose value counts, meaning."""
    from hvd_trainer.runtime import config
    check_variables()
    rows = ["| variable | default | whose value | meaning |", "|---|---|---|---|"]
    for name, meaning in SETTINGS.items():
        key = name[len("HVD_"):]
        if key in config.AGREED_SETTINGS:
            default, whose = _default(config.AGREED_SETTINGS[key][0]), "rank 0's"
        elif key in config.OWN_SETTINGS:
            default, whose = _default(config.OWN_SETTINGS[key][0]), "each rank's"
        else:
            default = OTHER_DEFAULTS[name]
            whose = "hvdrun's" if name in ("HVD_MPIEXEC", "HVD_START_TIMEOUT") else "each rank's"
        rows.append(f"| `{name}` | {default} | {whose} | {meaning} |")
    return "\n".join(rows)


def hvdrun_variables_table() -> str:
    """The variables hvdrun's side sets for the ranks."""
    check_variables()
    rows = ["| variable | set to |", "|---|---|"]
    rows += [f"| `{name}` | {meaning} |" for name, meaning in SET_BY_HVDRUN.items()]
    return "\n".join(rows)


def spelled(names: Tuple[str, ...], metavar: object = None) -> str:
    """A flag table's first column: each spelling in backticks, with its value's name."""
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return ", ".join(f"`{name} {metavar}`" if metavar else f"`{name}`" for name in names)


def flags_table() -> str:
    """hvdrun's flags: what each accepted one does, and why each refused one is refused."""
    from hvd_trainer_launch.job import flags
    rows = ["| flag | effect |", "|---|---|"]
    rows += [f"| {spelled(flag.names, flag.options.get('metavar'))} | {flag.effect} |"
             for flag in flags.FLAGS]
    rows += [f"| {spelled(entry.names)} | refused: {entry.reason} |" for entry in flags.REFUSED]
    return "\n".join(rows)


@functools.lru_cache(maxsize=None)
def _package() -> object:
    """The package as griffe reads it from the source, once (aliases resolve within it)."""
    import griffe
    return griffe.GriffeLoader(search_paths=[REPO]).load("hvd_trainer")


def public_names(module: str) -> Tuple[List[str], List[str], List[str]]:
    """MODULE's public names, read statically: its ``__all__`` if it has one, else what it
    defines or imports from hvd_trainer. Returned apart: the names griffe cannot follow to a
    definition (values unpacked from a tuple, such as the reduction ops), and the public
    submodules the module imports."""
    import griffe
    package = _package()
    loaded = package[module.partition(".")[2]] if "." in module else package
    exported = loaded.exports  # __all__, when the module has one
    names, plain, modules = [], [], []
    for name, member in loaded.members.items():
        if name.startswith("_") or (exported is not None and name not in exported):
            continue
        if member.is_alias:
            if not member.target_path.startswith("hvd_trainer"):
                continue  # typing, tensorflow, keras: not ours
            try:
                target = member.final_target
            except griffe.AliasResolutionError:
                plain.append(name)
                continue
            if target.is_module:
                modules.append(member.target_path)
                continue
        elif member.is_module:
            continue  # a submodule loaded beside the package, not one it imports
        names.append(name)
    return names, plain, modules


def api_block(module: str) -> str:
    """The mkdocstrings directives for MODULE's names and for the submodules it imports."""
    names, plain, modules = public_names(module)
    blocks = [f"::: {module}\n    options:\n      members: [{', '.join(names)}]"]
    if plain:
        blocks.append("Also: " + ", ".join(f"`{name}`" for name in plain) + ".")
    for submodule in modules:
        blocks.append(f"## `{submodule}`\n\n::: {submodule}\n    options:\n"
                      "      show_root_heading: false")
    return "\n\n".join(blocks)


_MARKER = re.compile(r"<!-- (generated|api): ([\w.-]+) -->")
_TABLES = {"hvdrun-flags": flags_table, "settings": settings_table,
           "hvdrun-variables": hvdrun_variables_table}


def expand(markdown: str) -> str:
    """``markdown`` with each marker replaced by what it stands for."""
    def replace(match: "re.Match[str]") -> str:
        kind, what = match.groups()
        if kind == "api":
            return api_block(what)
        if what not in _TABLES:
            raise ValueError(f"unknown generated table {what!r}; known: {sorted(_TABLES)}")
        return _TABLES[what]()
    return _MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, **_: object) -> str:
    """mkdocs hook: expand the page's markers before it is converted."""
    return expand(markdown)


_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **_: object) -> str:
    """mkdocs hook: drop the Sphinx role before each role-marked name in the page."""
    return _ROLE.sub("", html)
