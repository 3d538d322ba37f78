"""hvdrun's command line: the flags, Horovod's --config-file, --check-build, and the entry point
that checks them and hands the job to job/ (or elastic/)."""
