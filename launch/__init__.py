"""The ``hvdrun`` launcher: starts a training command on N ranks through the MPI's own mpiexec.

Installed as ``hvd_trainer_launch``. It imports neither hvd_trainer's core nor MXNet, so it
starts fast and works before the rest of the package is importable.
"""
