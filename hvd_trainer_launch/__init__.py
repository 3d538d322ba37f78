"""The ``hvdrun`` launcher and the engines: start a training command, or a function, on N ranks
through the MPI's own mpiexec (over ssh, or through a Spark or Ray engine's agents).

It imports nothing of hvd_trainer's core, MXNet or NumPy, so it starts fast and works before
the rest of the package is importable; the core imports it instead, for what both sides share:
the launcher–rank protocol (:mod:`hvd_trainer_launch.protocol`: variables, exit codes, output
lines, reports), the install hints (:mod:`hvd_trainer_launch.installs`), the signed-file format
and the output files (:mod:`hvd_trainer_launch.files`). docs/design.md lists every module.
"""
