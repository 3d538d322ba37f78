"""A size-1 world that needs no MPI, so `python train.py` runs without a launcher."""
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np


class _Done:
    """A request that completed when it was started."""

    @staticmethod
    def test() -> bool:
        return True


class LocalCommunicator:
    """Every collective of a single rank is a copy or nothing at all."""

    rank = 0
    size = 1

    def configure(self, algorithm: str, ring_threshold: int) -> None:
        """A single rank has no algorithm to choose."""

    def allreduce(self, buf: np.ndarray, op: str, out: Optional[np.ndarray] = None,
                  kernels: Any = None) -> None:
        # One rank: the reduction of a single contribution is that contribution.
        if out is not None and out is not buf:
            out[...] = buf

    def reduce_scatter(self, buf: np.ndarray, counts: Sequence[int], op: str,
                       kernels: Any = None) -> np.ndarray:
        return buf[: counts[0]]

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        recv[: counts[0]] = send[: counts[0]]

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        pass

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        recv[: recv_counts[0]] = send[: send_counts[0]]

    def repeated_allgather(self, send: np.ndarray, recv: np.ndarray) -> Callable[[], _Done]:
        def start() -> _Done:
            recv.reshape(-1)[:send.size] = send.reshape(-1)
            return _Done()
        return start

    def repeated_allreduce(self, send: np.ndarray, recv: np.ndarray,
                           op: str) -> Callable[[], _Done]:
        def start() -> _Done:
            recv[...] = send  # one rank's contribution is the reduction
            return _Done()
        return start

    def post(self, dest: int, message: Any) -> None:
        raise ValueError(f"rank {dest} does not exist in a size-1 world")

    def collect_posts(self) -> List[Tuple[int, Any]]:
        return []

    def allgather_object(self, obj: Any) -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return obj

    def split(self, ranks: Sequence[int]) -> Optional["LocalCommunicator"]:
        return self if 0 in ranks else None

    def local_and_cross(self) -> "tuple[LocalCommunicator, LocalCommunicator]":
        return self, self

    def barrier(self) -> None:
        pass

    def abort(self, code: int) -> None:
        os._exit(code)

    def free(self) -> None:
        pass

    def leave(self) -> None:
        pass
