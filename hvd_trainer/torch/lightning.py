"""A PyTorch Lightning 2 strategy over hvd_trainer.torch: ``Trainer(strategy=HorovodStrategy())``
in a script launched with hvdrun (or run by hvd_trainer.spark.run or RayExecutor).

Lightning 1.x had a ``HorovodStrategy`` (``strategy="horovod"``) and removed it in 2.0; this
one keeps its name and its behaviour: the ranks are hvd_trainer's, every optimizer becomes a
:func:`DistributedOptimizer` (gradients averaged across the ranks; ``accumulate_grad_batches``
passes per allreduce), rank 0's weights and optimizer state go to every rank before training,
each rank gets its share of the data through Lightning's DistributedSampler, and Lightning's
collectives (logging with ``sync_dist``, early stopping's decisions, checkpoints' barriers)
run on hvd_trainer's. ``HorovodStrategy.strategy_name`` is ``"horovod"``: after
``register_horovod_strategy()``, ``Trainer(strategy="horovod")`` works as in Lightning 1.x.
"""
import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from torch import Tensor

from hvd_trainer import torch as hvd

__all__ = ["HorovodStrategy", "register_horovod_strategy"]


def _reduce_op(reduce_op: Any) -> Any:
    """Lightning's reduce op ("mean"/"sum", or torch.distributed.ReduceOp) as hvd's."""
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
    if name in ("mean", "avg", "average", "reduceop.avg"):
        return hvd.Average
    if name in ("sum", "reduceop.sum"):
        return hvd.Sum
    if name in ("max", "reduceop.max"):
        return hvd.Max
    if name in ("min", "reduceop.min"):
        return hvd.Min
    raise ValueError(f"HorovodStrategy.reduce: reduce_op={reduce_op!r} is not one of mean, "
                     "sum, max, min")


class HorovodStrategy(ParallelStrategy):
    """Data-parallel training on hvd_trainer's ranks (one process per rank, as hvdrun starts
    them); on a rank with a GPU, the GPU of its local rank."""

    strategy_name = "horovod"

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=None, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        hvd.init()

    @property
    def global_rank(self) -> int:
        return hvd.rank()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    @property
    def node_rank(self) -> int:
        return hvd.cross_rank()

    @property
    def world_size(self) -> int:
        return hvd.size()

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", hvd.local_rank())
        return devices[0]

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then the optimizers wrapped and rank 0's state everywhere."""
        super().setup(trainer)
        if not self.optimizers:
            return
        model = self.lightning_module
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        passes = max(1, int(trainer.accumulate_grad_batches))
        wrapped = []
        for optimizer in self.optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            names = {p: n for n, p in model.named_parameters()}
            named = [(names[p], p) for group in optimizer.param_groups for p in group["params"]
                     if p in names]
            wrapped.append(hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                    backward_passes_per_step=passes))
        # The wrapped optimizers share the originals' parameter groups, so learning-rate
        # schedulers built on the originals set the rates the wrapped ones use.
        self.optimizers = wrapped

    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        assert self.model is not None
        self.model.to(self.root_device)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """The step after the closure's backward and the gradients' allreduce (the closure
        runs inside ``optimizer.step``, so the allreduce is awaited there, not before)."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own

        def closure_then_synchronize() -> Any:
            loss = closure()
            inner.synchronize()
            return loss

        with inner.skip_synchronize():
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def barrier(self, name: Optional[str] = None) -> None:
        hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def reduce(self, tensor: Union[Tensor, Any], group: Any = None,
               reduce_op: Any = "mean") -> Union[Tensor, Any]:
        """``tensor`` reduced across the ranks (Lightning's mean, sum, max or min)."""
        if not isinstance(tensor, Tensor):
            return tensor
        return hvd.allreduce(tensor.detach(), op=_reduce_op(reduce_op))

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor``, stacked along a new first dimension."""
        gathered = hvd.allgather(tensor.detach().unsqueeze(0))
        return gathered

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        yield None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="hvd_trainer's Horovod-style strategy")


def register_horovod_strategy() -> None:
    """Let ``Trainer(strategy="horovod")`` name this strategy (as in Lightning 1.x)."""
    if HorovodStrategy.strategy_name not in StrategyRegistry:
        HorovodStrategy.register_strategies(StrategyRegistry)
