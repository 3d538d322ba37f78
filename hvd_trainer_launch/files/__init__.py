"""Files the launcher and the ranks write safely: private folders that name their maker
(owned_folders), signed files (signed), and output files that never end the job (outputs); and
the session folders that Open MPI's killed launchers left, which would stop a later one
(open_mpi_sessions)."""
