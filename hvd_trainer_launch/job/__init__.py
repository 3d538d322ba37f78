"""One MPI job under watch: hvdrun's flags turned into the ranks' variables and mpiexec's
arguments (flags), mpiexec run with the ranks' environment (watch), the output relay and the
wrappers' report port (relay, reports)."""
