"""The ``hvdrun`` launcher: starts a training command on N ranks through the MPI's own mpiexec.

Installed as ``hvd_trainer_launch``. It imports neither MXNet nor, for a plain job, hvd_trainer's
core, so it starts fast and works before the rest of the package is importable; elastic mode
and --output-filename import hvd_trainer.runtime.files, the one module that writes files safely and
signs with the job's secret. What the launcher and the ranks tell each other (variables, exit
codes, output lines, reports) is in :mod:`hvd_trainer_launch.protocol`, standard library only,
which the core imports too.
"""
