"""What runs on each rank's host around the user's command: the per-rank wrapper that mpiexec
starts (wrapper), the MPI shared-memory files it removes after the rank (segments), and the
``horovod`` package that --horovod puts on the rank's path (horovod_shim)."""
