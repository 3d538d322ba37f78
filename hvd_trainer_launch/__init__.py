"""The ``hvdrun`` launcher: starts a training command on N ranks through the MPI's own mpiexec.

Installed as ``hvd_trainer_launch``. It imports neither MXNet nor hvd_trainer's core (only
``--check-build`` reads the core's install hints), so it starts fast and works before the rest
of the package is importable; the per-rank files of --output-filename are written by
:mod:`hvd_trainer_launch.files.outputs`, which the ranks' own outputs use too. What the launcher
and the ranks tell each other (variables, exit codes, output lines, reports) is in
:mod:`hvd_trainer_launch.protocol`, standard library only, which the core imports too.
"""
