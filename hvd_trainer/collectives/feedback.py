"""Error-feedback sums: packed payloads that cannot be summed in place travel by allgather.

Every rank encodes its gradient with a codec (a :class:`hvd_trainer.compression.GatherCompressor`),
keeping what it did not send in a per-tensor residual; one allgather carries every rank's
payloads, and every rank decodes and sums them in rank order, so all ranks apply
bit-identical updates.
"""
import time
from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import numpy as np

from . import ops
from ..runtime.runtime import ProcessSet, global_process_set
from .traffic import CommStats


def decode_sum(codec: Any, every: Any, offsets: Sequence[int], tensors: Sequence[Any],
               scale: float) -> None:
    """Replace each tensor by the sum of what every rank's payload (a row of ``every``, cut at
    ``offsets``) carries for it, times ``scale``; NumPy or CuPy arrays alike. A codec with a
    ``decode_two`` (every ``GatherCompressor``) decodes the first two payloads at once."""
    two = getattr(codec, "decode_two", None) if len(every) >= 2 else None
    for t, start, end in zip(tensors, offsets[:-1], offsets[1:]):
        flat = t.reshape(-1)
        if two is not None:
            two(every[0][start:end], every[1][start:end], flat)
        else:
            flat[...] = 0
        for payload in every[0 if two is None else 2:]:  # rank order, the same on every rank
            codec.decode_add(payload[start:end], flat)
        if scale != 1.0:
            flat *= np.float32(scale)


class ErrorFeedbackSum:
    """Sums gradients across ranks through a ``GatherCompressor``, with one residual per
    tensor key on this rank (the state ``save_checkpoint`` keeps)."""

    def __init__(self, compressor: Any):
        self.compressor = compressor
        self.residuals: Dict[Hashable, np.ndarray] = {}

    def state(self) -> Dict[Hashable, np.ndarray]:
        """This rank's residuals, for checkpoints and elastic commits."""
        return self.residuals

    def restore(self, saved: Optional[Dict[Hashable, np.ndarray]]) -> None:
        """Continue from what :meth:`state` returned (None: residuals start from zero)."""
        self.residuals = dict(saved or {})

    def sum_(self, named: Sequence[Tuple[Hashable, np.ndarray]], name: str, scale: float = 1.0,
             process_set: ProcessSet = global_process_set,
             stats: Optional[CommStats] = None) -> None:
        """Replace each (C-contiguous float32) tensor by the sum over ranks of what they sent,
        times ``scale``; one allgather carries every payload."""
        codec = self.compressor
        sizes = [codec.wire_bytes(t.size) for _, t in named]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        send = np.empty(offsets[-1], np.uint8)
        tic = time.perf_counter()
        for (key, t), start, end in zip(named, offsets[:-1], offsets[1:]):
            residual = self.residuals.get(key)
            if residual is None:
                residual = self.residuals[key] = np.zeros(t.size, np.float32)
            payload = codec.encode(t.reshape(-1), residual)
            if payload.dtype != np.uint8 or payload.shape != (end - start,):
                raise ValueError(f"{type(codec).__name__}.encode returned {payload.dtype} of "
                                 f"shape {payload.shape}; it must return wire_bytes(size) = "
                                 f"{end - start} bytes as a 1-D uint8 array")
            send[start:end] = payload
        encoded = time.perf_counter()
        every = ops.allgather(send, name, process_set).reshape(-1, send.size)
        gathered = time.perf_counter()
        decode_sum(codec, every, offsets, [t for _, t in named], scale)
        if stats is not None:
            stats.add_allgather(every.shape[0], send.size, sum(t.nbytes for _, t in named),
                                encoded - tic, time.perf_counter() - gathered)
