"""Collectives that autograd's backward has still to make (SyncBatchNorm's allreduce), counted
so that DistributedOptimizer holds its gradients back until they have run.

A DistributedOptimizer step occupies the communication thread from the first gradient it
hands to the reducer until the last; a collective queued behind it from inside backward would
wait for gradients that backward cannot produce until that collective returns.
"""
_pending = 0


def expect() -> None:
    """A forward pass recorded a collective that its backward will make."""
    global _pending
    _pending += 1


def done() -> None:
    """A backward pass made one expected collective."""
    global _pending
    _pending = max(_pending - 1, 0)


def pending() -> bool:
    """Whether a recorded backward collective has not run yet."""
    return _pending > 0


def forget() -> None:
    """Forget what was expected (a step is over; forwards without backward leave counts)."""
    global _pending
    _pending = 0
