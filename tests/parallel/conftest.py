"""Settings shared by every multi-rank test job."""
import os

# Open MPI probes the libfabric and UCX transports at every start, about 1 s per job on a
# machine without such a fabric (the tests' one machine uses shared memory anyway). MPICH
# ignores the variable.
os.environ.setdefault("OMPI_MCA_btl", "^ofi,uct")
