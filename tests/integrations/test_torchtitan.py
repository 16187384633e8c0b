"""KFACOptimizer as the optimizer of torchtitan's ``OptimizersContainer`` (a subclass, as
the container's docstring invites), on torchtitan's llama3 debug model sharded by its own
``apply_fsdp_to_decoder`` at world 2 on CPU (gloo), saved and resumed through its DCP
``CheckpointManager``; against the hand-written FSDP2 loop on the same ranks.

What of torchtitan does not run here, and why (docs/integrations.md says the same):
its ``Trainer`` and ``ParallelDims.build_mesh`` take the device type from
``torchtitan.tools.utils.device_type``, which is ``"cuda"`` on a host without an
accelerator, so the mesh is built here with ``init_device_mesh("cpu", ...)``; the debug
model's FlexAttention has no backward on CPU, so its layers use torchtitan's
``ScaledDotProductAttention`` (as torchtitan's own graph_trainer tests do); and
``torchtitan.models`` imports ``triton`` (its MoE expert-parallel kernels) without
declaring it, which the CPU torch lacks: the import gets a stand-in that refuses any use
(the dense model never calls those kernels), removed again once the import is done; and
``apply_fsdp_to_decoder`` turns FSDP's gradient division off, which reduces with
``PREMUL_SUM(1.0)``, which gloo lacks: FSDP2's plain sum reduction is forced instead.
"""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACOptimizer, KFACPreconditioner

pytest.importorskip(
    "torchtitan.components.optimizer", reason="torchtitan is not installed (Python >= 3.11)"
)
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    ParamGroupConfig,
)

KFAC: dict[str, Any] = {"damping": 0.01, "inv_update_steps": 2, "skip_layers": ("lm_head",)}
ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS = 3
SAVED_AT = 2
ROWS = 2  # sequences per rank and step
SEQ = 16
LAYERS = 2  # of the debug model's 6, to keep the test short


# --8<-- [start:torchtitan]
class KFACOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, K-FAC preconditioning its one optimizer."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        kfac: dict[str, Any] = field(default_factory=dict)  # KFACOptimizer's options

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        if len(model_parts) != 1 or len(self.optimizers) != 1:
            raise ValueError("K-FAC takes one model part and one optimizer type here")
        self.optimizers = [KFACOptimizer(model_parts[0], self.optimizers[0], **config.kfac)]

    def state_dict(self) -> dict[str, Any]:
        # The container keeps each optimizer's FQN-keyed "state" and "param_groups" only:
        # the preconditioner's state travels beside them.
        kfac = self.optimizers[0].preconditioner.dcp_state_dict()
        return {**super().state_dict(), "kfac": kfac}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # after its lr = 0 initialisation step
        self.optimizers[0].preconditioner.load_dcp_state_dict(state_dict["kfac"])


def build_optimizers(model: nn.Module) -> Any:
    config = KFACOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs=ADAMW)],
        implementation="for-loop", kfac=KFAC,
    )  # fmt: skip
    return config.build(model_parts=[model])


# --8<-- [end:torchtitan]


class _Refused:
    """A stand-in for every name of ``triton``: defining kernels works, launching fails."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getitem__(self, grid: Any) -> Any:
        raise RuntimeError("triton is not installed: torchtitan's kernels cannot run here")


def _module_attribute(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Refused()


def _import_without_triton(name: str) -> Any:
    """``import name``; where only ``triton`` is missing, again with a stand-in for it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
    # Every torch module on the way is imported now, having seen no triton: the stand-in
    # reaches torchtitan's own imports only.
    stand_ins = {}
    for module in ("triton", "triton.language"):
        stand_ins[module] = types.ModuleType(module)
        stand_ins[module].__getattr__ = _module_attribute  # type: ignore[method-assign]
    try:
        sys.modules.update(stand_ins)
        return importlib.import_module(name)
    finally:
        for module in stand_ins:
            sys.modules.pop(module, None)


def _debug_model(mesh: Any) -> nn.Module:
    """torchtitan's llama3 "debugmodel" (dim 256) cut to ``LAYERS`` of its 6 layers, FSDP2
    by torchtitan's own function."""
    llama3 = _import_without_triton("torchtitan.models.llama3")
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = llama3.model_registry("debugmodel").model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    # It turns FSDP's gradient division off (the loss is divided by the global token
    # count instead), which reduces with PREMUL_SUM(1.0): gloo has no PREMUL_SUM, so sum.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def _loss(model: nn.Module, step: int, rank: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 2048, (2 * ROWS, SEQ + 1), generator=g)[rank * ROWS :][:ROWS]
    positions = torch.arange(SEQ).expand(ROWS, SEQ)
    logits = model(tokens[:, :-1], positions=positions)
    # torchtitan's loss: every rank's token losses summed over the global token count.
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    return loss / (2 * ROWS * SEQ)


def _schedulers(optimizers: Any) -> Any:
    return LRSchedulersContainer.Config(warmup_steps=1, decay_type="linear").build(
        optimizers=optimizers, training_steps=STEPS
    )


def _checkpointer(folder: Path, model: nn.Module, optimizers: Any, schedulers: Any) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVED_AT)
    return config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={}, sd_adapter=None, base_folder=str(folder),
    )  # fmt: skip


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _container_run(mesh: Any, rank: int, folder: Path, steps: range) -> dict[str, Any]:
    """torchtitan's loop: a fresh container resumes from the checkpoint when ``steps``
    starts after 0, and saves after ``SAVED_AT`` steps otherwise."""
    model = _debug_model(mesh)
    optimizers = build_optimizers(model)
    schedulers = _schedulers(optimizers)
    checkpointer = _checkpointer(folder, model, optimizers, schedulers)
    if steps.start:
        # The container's lr = 0 step on zero gradients (which creates AdamW's state before
        # a load) leaves the weights and the preconditioner as they were.
        before = _params(model)
        optimizers.state_dict()
        kfac = optimizers.optimizers[0]
        assert kfac.state and kfac.preconditioner.steps == 0
        assert all(f is None for f in kfac.preconditioner.factors(kfac.preconditioner.layers[0]))
        for name, value in _params(model).items():
            torch.testing.assert_close(value, before[name], rtol=0, atol=1e-12)
        assert checkpointer.load(step=steps.start)
        assert optimizers.optimizers[0].preconditioner.steps == steps.start
    for step in steps:
        optimizers.zero_grad()
        _loss(model, step, rank).backward()
        optimizers.step()
        schedulers.step()
        if step + 1 == SAVED_AT and not steps.start:
            checkpointer.save(curr_step=step + 1)
    checkpointer.close()
    # Per-parameter state keyed by fully qualified name, the preconditioner's beside it.
    saved = optimizers.state_dict()
    assert "state.layers.0.feed_forward.w1.weight.exp_avg" in saved and "kfac" in saved
    assert isinstance(optimizers, KFACOptimizersContainer)
    assert optimizers.optimizers[0].preconditioner.steps == STEPS
    return {"params": _params(model), "lr_lambda": schedulers.schedulers[0].lr_lambdas[0]}


def _by_hand(mesh: Any, rank: int, lr_lambda: Any) -> dict[str, Tensor]:
    model = _debug_model(mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    precond = KFACPreconditioner(model, optimizer=optimizer, **KFAC)
    for step in range(STEPS):
        optimizer.zero_grad()
        _loss(model, step, rank).backward()
        if precond.step():
            optimizer.step()
        scheduler.step()
    return _params(model)


def _rank(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    full = _container_run(mesh, rank, Path(folder), range(STEPS))
    resumed = _container_run(mesh, rank, Path(folder), range(SAVED_AT, STEPS))
    by_hand = _by_hand(mesh, rank, full["lr_lambda"])
    return {"full": full["params"], "resumed": resumed["params"], "by_hand": by_hand}


def test_container_fsdp2_world_two_equals_hand_written_loop_and_resumes(tmp_path: Path) -> None:
    results = run_distributed(_rank, 2, str(tmp_path), timeout=240, collective_timeout=120)
    for result in results:
        for name, value in result["full"].items():
            # float32 (torchtitan's model): the same operations in the same order.
            torch.testing.assert_close(value, result["by_hand"][name], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(result["resumed"][name], value, rtol=1e-6, atol=1e-7)
