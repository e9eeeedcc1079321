"""Trainers on 2 CPU processes (gloo): the Lightning callback under ``strategy="ddp"``, the FSDP2
recipe under Lightning's ``ModelParallelStrategy``, and the Hugging Face ``Trainer`` callback
under DDP (``ddp_backend="gloo"``).

The processes are started here, with the environment a launcher gives (``LOCAL_RANK``,
``WORLD_SIZE``, ...), so Lightning takes them as created outside it. Each rank trains the same
model with dropout for 3 steps, without autoremat and with it, and compares:

* DDP with the callback: the plan is made on rank 0 and sent to every rank
  (:func:`autoremat.broadcast_plan`, inside the callback), so both ranks recompute the same
  modules (rank 1 is given another budget, to show it); losses and DDP-averaged gradients at
  every step are bitwise those without the callback;
* ``ModelParallelStrategy``: a plan made before sharding, applied in ``configure_model``
  before ``fully_shard``, trains bitwise as without it; the callback on the model the
  strategy already sharded is refused on every rank.
"""

from __future__ import annotations

import functools
import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autoremat.comparison.recomputed import RecomputeCounter
from launch_ranks import run_ranks, worker_main

WORLD = 2
TIMEOUT = 600
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed/gloo"
)


@functools.cache
def _module_class(pl: Any) -> Any:
    """A LightningModule of 6 blocks (Linear, GELU, Dropout) and a head. With ``shard``, its
    ``configure_model`` applies its ``plan`` (if any), then ``fully_shard`` on each block and
    on the head (the FSDP2 recipe); it records each step's loss and full gradients."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Net(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, plan: Any = None, shard: bool = False) -> None:
            super().__init__()
            self.plan, self.shard = plan, shard
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1)) for _ in range(6)
            )
            self.head = nn.Linear(128, 1)
            self.losses: list[torch.Tensor] = []
            self.grads: list[list[torch.Tensor]] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

        def configure_model(self) -> None:
            if self.plan is not None:
                self.plan.apply(self)
            if self.shard:
                mesh = self.device_mesh["data_parallel"]
                for block in self.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.head, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads.append([getattr(p.grad, "full_tensor", p.grad.clone)()
                               for p in self.parameters()])  # fmt: skip

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Net


def _run(pl: Any, callbacks: list[Any], plan: Any = None, shard: bool = False,
         strategy: Any = "ddp") -> Any:  # fmt: skip
    """3 steps on both ranks: under ``strategy`` (``"ddp"``), or with ``shard`` under
    ``ModelParallelStrategy`` (FSDP2 over both ranks); the module, as trained."""
    from pytorch_lightning.strategies import ModelParallelStrategy

    pl.seed_everything(0, verbose=False)
    module = _module_class(pl)(plan, shard)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(6 * 128, 128, generator=g),
                                          torch.randn(6 * 128, 1, generator=g))  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=128)
    parallel = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=WORLD,
                         strategy=parallel if shard else strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(module, loader)
    return module


def _same(plain: Any, planned: Any) -> list[bool]:
    """Three steps each; bitwise equal losses; bitwise equal gradients at every step."""
    return [
        len(plain.losses) == len(planned.losses) == 3,
        all(torch.equal(a, b) for a, b in zip(plain.losses, planned.losses, strict=True)),
        all(torch.equal(a, b) for mine, theirs in zip(plain.grads, planned.grads, strict=True)
            for a, b in zip(mine, theirs, strict=True)),
    ]


def _sharded(pl: Any, rank: int) -> dict[str, Any]:
    """Under ``ModelParallelStrategy``: the FSDP2 recipe (a plan made before sharding, applied
    in ``configure_model``) against no plan; the callback (planning on the shadow it keeps
    before sharding) against no plan; and the planner on a module already sharded, refused."""
    import autoremat
    from autoremat.integrations.first_batch import FirstBatchPlanner
    from autoremat.integrations.lightning_callback import AutoRematLightning

    x = torch.randn(128, 128)  # (one rank's batch)
    plan = autoremat.plan(_module_class(pl)(), (x,), budget="80%", objective="flops")
    plain = _run(pl, [], shard=True)
    with RecomputeCounter() as seen:
        planned = _run(pl, [], plan, shard=True)
    callback = AutoRematLightning(budget="50%" if rank == 0 else "95%", objective="flops")
    with RecomputeCounter() as seen_callback:
        called = _run(pl, [callback], shard=True)
    assert callback.plan is not None
    already = _run(pl, [], shard=True)  # (sharded, its forward hooked by the planner alone)
    FirstBatchPlanner(budget="50%").attach(already)
    try:
        already(torch.randn(128, 128))
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"sharded_plan": list(plan.modules), "sharded_same": _same(plain, planned),
            "sharded_missing": seen.missing(plan.modules), "refused": refused,
            "callback_plan": list(callback.plan.modules), "callback_same": _same(plain, called),
            "callback_missing": seen_callback.missing(callback.plan.modules)}  # fmt: skip


def _hf_worker(rank: int, out: Path) -> None:
    """The Hugging Face Trainer under DDP (gloo): without the callback, then with it."""
    import transformers

    from autoremat.integrations.huggingface_trainer import AutoRematCallback
    from test_integrations import _gpt2, _Recorded, _rows

    torch.set_num_threads(1)

    def train(callbacks: list[Any], where: str) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(out / where), max_steps=3, per_device_train_batch_size=4,
            learning_rate=1e-3, seed=0, report_to="none", use_cpu=True, logging_steps=1,
            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo",
        )  # fmt: skip
        trainer = _Recorded(model=_gpt2(), args=args, train_dataset=_rows(), callbacks=callbacks)
        trainer.train()
        return trainer

    plain = train([], "plain")
    # (another budget on rank 1: its own plan would differ; it must get rank 0's)
    callback = AutoRematCallback(budget="50%" if rank == 0 else "95%", objective="flops")
    with RecomputeCounter() as seen:
        planned = train([callback], "planned")
    assert callback.plan is not None
    found = {"plan": list(callback.plan.modules), "same": _same(plain, planned),
             "missing": seen.missing(callback.plan.modules),
             "wrapped": type(planned.model_wrapped).__name__,
             "grads": [g.sum().item() for g in planned.grads[0]]}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(found))


def _worker(rank: int, out: Path) -> None:
    import pytorch_lightning as pl

    from autoremat.integrations.lightning_callback import AutoRematLightning

    torch.set_num_threads(1)
    plain = _run(pl, [])
    # (another budget on rank 1: its own plan would differ; it must get rank 0's)
    callback = AutoRematLightning(budget="50%" if rank == 0 else "95%", objective="flops")
    with RecomputeCounter() as seen:
        planned = _run(pl, [callback])
    assert callback.plan is not None
    same = _same(plain, planned)
    found = {"plan": list(callback.plan.modules), "same": same,
             "missing": seen.missing(callback.plan.modules),
             "grads": [g.sum().item() for g in planned.grads[0]], **_sharded(pl, rank)}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(found))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(mode: str, out: Path) -> list[dict[str, Any]]:
    """Run ``mode``'s worker (``lightning`` or ``huggingface``) on :data:`WORLD` processes,
    with the environment a launcher such as ``torchrun`` gives."""
    port = str(_free_port())

    def env(r: int) -> dict[str, str]:
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(WORLD),
                "RANK": str(r), "LOCAL_RANK": str(r), "NODE_RANK": "0"}  # fmt: skip

    return run_ranks(__file__, WORLD, out, lambda r: [mode, str(r), str(out)], env, TIMEOUT)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("pytorch_lightning")
    return _launch("lightning", tmp_path_factory.mktemp("lightning_ranks"))


@pytest.fixture(scope="module")
def hf_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _launch("huggingface", tmp_path_factory.mktemp("hf_ranks"))


@pytest.mark.slow
def test_the_trainer_callback_under_ddp_plans_once_and_trains_exactly(hf_ranks):
    """The Hugging Face Trainer on 2 processes (``ddp_backend="gloo"``; the Trainer wraps the
    model in DDP): both ranks apply rank 0's plan (rank 1 was given another budget), every
    entry is recomputed, and losses and gradients at every step are bitwise those without
    the callback."""
    assert hf_ranks[0]["plan"] and hf_ranks[0]["plan"] == hf_ranks[1]["plan"]
    for r in hf_ranks:
        assert r["wrapped"] == "DistributedDataParallel"
        assert r["same"] == [True, True, True] and r["missing"] == []
    assert hf_ranks[0]["grads"] == hf_ranks[1]["grads"]


@pytest.mark.slow
def test_the_lightning_callback_under_ddp_plans_once_and_trains_exactly(ranks):
    """Both ranks apply rank 0's plan (not empty; rank 1 was given another budget, whose plan
    would differ), and train bitwise as without the callback (losses, and the gradients DDP
    averaged, at every step); the ranks' gradients agree."""
    assert ranks[0]["plan"] and ranks[0]["plan"] == ranks[1]["plan"]
    for r in ranks:
        assert r["same"] == [True, True, True]
        assert r["missing"] == []  # every entry ran ops in a recompute
    assert ranks[0]["grads"] == ranks[1]["grads"]


@pytest.mark.slow
def test_under_model_parallel_a_plan_applied_before_fully_shard_trains_exactly(ranks):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 over both ranks): a plan made before
    sharding and applied in ``configure_model`` before ``fully_shard`` trains bitwise as
    without it (losses, full gradients at every step); so does the callback, which plans on
    the shadow it kept before sharding, rank 0's plan on both ranks (rank 1 was given another
    budget), every entry recomputed; the first-batch planner alone on a module already
    sharded is refused, naming the recipe. (Lightning's ``FSDPStrategy`` and FSDP1 itself
    need a GPU on torch 2.13: not tested here.)"""
    assert ranks[0]["callback_plan"] and ranks[0]["callback_plan"] == ranks[1]["callback_plan"]
    for r in ranks:
        assert r["sharded_plan"] and r["sharded_same"] == [True, True, True]
        assert r["sharded_missing"] == []  # every entry ran ops in a recompute
        assert r["callback_same"] == [True, True, True] and r["callback_missing"] == []
        assert "already sharded by FSDP" in r["refused"] and "configure_model" in r["refused"]


if __name__ == "__main__":
    _mode, _rank, _out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    worker_main(lambda: (_worker if _mode == "lightning" else _hf_worker)(_rank, _out))
