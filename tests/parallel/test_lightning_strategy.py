"""hvd_trainer.torch.lightning.HorovodStrategy (Lightning 2) under hvdrun
(workers/lightning_strategy.py): a LightningModule's weights after training with it equal
Lightning's DDP strategy's (CPU, gloo) on the same ranks and data, on 3 ranks and on 2; its
collectives against arithmetic, and ``strategy="horovod"`` once registered."""
import pytest

from runner import case_job, case_names

pytest.importorskip("pytorch_lightning")


@pytest.mark.parametrize("case", case_names("lightning_strategy.py"))
def test_horovod_strategy_on_three_ranks(case):
    case_job("lightning_strategy.py", 3, timeout=300).check(case)


def test_horovod_strategy_equals_ddp_on_two_ranks():
    case_job("lightning_strategy.py", 2, args=("equals_lightning_ddp",),
             timeout=300).check("equals_lightning_ddp")
