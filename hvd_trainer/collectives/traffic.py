"""What a training step's collectives moved: bytes per rank and codec time, by algorithm."""
from dataclasses import dataclass


@dataclass
class CommStats:
    """One rank's traffic and codec time, summed over the collectives of a training step.

    Bytes follow the algorithms: a ring allreduce of B bytes sends and receives 2(N−1)/N·B
    per rank; an allgather of P bytes per rank sends (N−1)·P and receives the others'
    payloads. ``dense_bytes`` is what a float allreduce of the same gradients would send.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add_allgather(self, ranks: int, payload_bytes: int, dense_bytes: int,
                      encode_seconds: float, decode_seconds: float) -> None:
        """Count an allgather of this rank's ``payload_bytes`` standing for ``dense_bytes``."""
        self.bytes_sent += (ranks - 1) * payload_bytes
        self.bytes_received += (ranks - 1) * payload_bytes
        self.dense_bytes += round(2 * (ranks - 1) / ranks * dense_bytes)
        self.encode_seconds += encode_seconds
        self.decode_seconds += decode_seconds

    def add_allreduce(self, payload_bytes: int, dense_bytes: int, size: int) -> None:
        """Count a ring allreduce of ``payload_bytes`` standing for ``dense_bytes``."""
        ring = 2 * (size - 1) / size
        self.bytes_sent += round(ring * payload_bytes)
        self.bytes_received += round(ring * payload_bytes)
        self.dense_bytes += round(ring * dense_bytes)
