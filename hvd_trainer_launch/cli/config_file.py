"""Reading horovodrun's ``--config-file``: Horovod's YAML settings, turned into the flags they stand for.

Horovod's config is a mapping of sections (``params``, ``stall_check``, ...) to mappings of
scalars, plus ``controller: mpi|gloo``. hvdrun reads that block-style subset of YAML itself, so
the launcher needs no YAML library; anything else in the file is an error naming its line.
"""
import re
from typing import Dict, List, Tuple, Union

Scalar = Union[str, int, float, bool, None]

# (section, key) -> the flag it stands for. A boolean key given as true uses the first flag,
# as false the second; other keys pass their value to the flag.
KEYS: Dict[Tuple[str, str], Tuple[str, ...]] = {
    ("", "controller"): ("--mpi", "--gloo"),  # a value: mpi or gloo
    ("params", "fusion_threshold_mb"): ("--fusion-threshold-mb",),
    ("params", "cycle_time_ms"): ("--cycle-time-ms",),
    ("params", "cache_capacity"): ("--cache-capacity",),
    ("params", "hierarchical_allreduce"): ("--hierarchical-allreduce", "--no-hierarchical-allreduce"),
    ("params", "hierarchical_allgather"): ("--hierarchical-allgather", "--no-hierarchical-allgather"),
    ("autotune", "enabled"): ("--autotune", "--no-autotune"),
    ("autotune", "log_file"): ("--autotune-log-file",),
    ("autotune", "warmup_samples"): ("--autotune-warmup-samples",),
    ("autotune", "steps_per_sample"): ("--autotune-steps-per-sample",),
    ("autotune", "bayes_opt_max_samples"): ("--autotune-bayes-opt-max-samples",),
    ("autotune", "gaussian_process_noise"): ("--autotune-gaussian-process-noise",),
    ("timeline", "filename"): ("--timeline-filename",),
    ("timeline", "mark_cycles"): ("--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    ("stall_check", "enabled"): ("--stall-check", "--no-stall-check"),
    ("stall_check", "warning_time_seconds"): ("--stall-check-warning-time-seconds",),
    ("stall_check", "shutdown_time_seconds"): ("--stall-check-shutdown-time-seconds",),
    ("library_options", "mpi_threads_disable"): ("--mpi-threads-disable", "--no-mpi-threads-disable"),
    ("library_options", "num_nccl_streams"): ("--num-nccl-streams",),
    ("library_options", "thread_affinity"): ("--thread-affinity",),
    ("library_options", "gloo_timeout_seconds"): ("--gloo-timeout-seconds",),
    ("logging", "level"): ("--log-level",),
    ("logging", "with_timestamp"): ("--log-with-timestamp", "--log-without-timestamp"),
}

_LINE = re.compile(r"(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*:(?:\s+(?P<value>.*?))?\s*\Z")
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


class ConfigError(ValueError):
    """The config file cannot be read; the message names the file, the line and the fix."""


def read(path: str) -> Dict[Tuple[str, str], Scalar]:
    """Read the settings of ``path`` as {(section, key): value}; top-level keys have section ''."""
    with open(path) as lines:
        text = lines.read().splitlines()
    settings: Dict[Tuple[str, str], Scalar] = {}
    section = None
    for number, line in enumerate(text, 1):
        content = _strip_comment(line)
        if not content.strip() or content.strip() in ("---", "..."):
            continue
        match = _LINE.match(content)
        if not match:
            raise ConfigError(f"{path}:{number}: {line.strip()!r} is not `key: value`; hvdrun reads "
                              "the block-style YAML of Horovod's config (sections of scalars)")
        key, value = match["key"], match["value"]
        if match["indent"]:
            if section is None or value is None:
                raise ConfigError(f"{path}:{number}: {key!r}: settings are one level deep, "
                                  "a section (e.g. `params:`) and indented `key: value` lines")
            settings[section, key] = _scalar(value, path, number)
        elif value is None:
            section = key
        else:
            section = None
            settings["", key] = _scalar(value, path, number)
    return settings


def arguments(path: str) -> List[Tuple[str, List[str]]]:
    """The flags the settings of ``path`` stand for, as (setting name, [flag, value...]) pairs.

    Raises ConfigError for a key Horovod's config does not have or a value of the wrong kind.
    """
    result = []
    for (section, key), value in read(path).items():
        name = f"{section}.{key}" if section else key
        flags = KEYS.get((section, key))
        if flags is None:
            raise ConfigError(f"{path}: {name} is not a setting of horovodrun 0.28.1's config; "
                              "remove it")
        if value is None:
            continue
        if (section, key) == ("", "controller"):
            if str(value).lower() not in ("mpi", "gloo"):
                raise ConfigError(f"{path}: controller: {value!r} is not mpi or gloo")
            result.append((name, [flags[str(value).lower() == "gloo"]]))
        elif len(flags) == 2:
            if not isinstance(value, bool):
                raise ConfigError(f"{path}: {name}: {value!r} is not true or false")
            result.append((name, [flags[0] if value else flags[1]]))
        else:
            result.append((name, [flags[0], str(value)]))
    return result


def _strip_comment(line: str) -> str:
    """The line without a ``#`` comment (a # inside quotes or glued to a word is kept)."""
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def _scalar(text: str, path: str, number: int) -> Scalar:
    """A YAML scalar: quoted string, null, boolean, integer, float or plain string."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text[:1] in ("[", "{", "&", "*", "!", "|", ">") or text.startswith("- "):
        raise ConfigError(f"{path}:{number}: {text!r}: hvdrun reads plain YAML scalars only "
                          "(no lists, flow mappings, anchors, tags or block text)")
    lowered = text.lower()
    if lowered in ("null", "~"):
        return None
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
