"""Elastic training (horovod.elastic's API): state that survives the loss of a rank.

An MPI world cannot drop a dead process, so recovery restarts the processes: ``hvdrun
--min-np/--max-np`` ends every rank when one fails or the hosts change and starts them again
(under ``hvdrun --ulfm``, Open MPI's fault-tolerance extensions let the survivors of a killed
rank shrink the world and go on in their processes instead: see :func:`run`).
``State.commit()`` copies the state into memory that the state keeps for its commits, and a
background thread writes that copy to a file in each rank's job folder (``HVD_ELASTIC_DIR``,
set by hvdrun per job, in memory under /dev/shm where the host has it), signed with the
job's secret; :func:`run` restores, on every rank, the newest intact commit that any rank
still holds before it calls the training function again. Framework adapters subclass
:class:`ObjectState` (see :mod:`hvd_trainer.mxnet.elastic` and
:mod:`hvd_trainer.torch.elastic`) and register their tensor types
(:func:`register_array_type`), so that a commit copies tensors instead of pickling them.

The package's modules, one job each: commits.py (the commit format), store.py (the writer
thread and the commit store), notices.py (hvdrun's notices of other hosts), state.py (State
and run), sampler.py (ElasticSampler), lives.py (restart counts and lost commits). The names
below are the public API (horovod.elastic's, and the error a restart without commits raises).
"""
from .commits import register_array_type
from .lives import CommitsLostError
from .sampler import ElasticSampler
from .state import HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["CommitsLostError", "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt",
           "ObjectState", "State", "register_array_type", "run"]
