"""torchtitan's tensor-parallel plan for the LLaMA layout (:mod:`spdkfac.models.llama`),
applied with DTensor's ``parallelize_module``, and the FSDP2 × TP wrapping of ``spdkfac
train --fsdp --tp-size`` (``torch.distributed`` APIs, hence here)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from spdkfac.comm.distributed import TorchDistributedCommunicator

__all__ = ["TENSOR_PARALLEL_PLANS", "parallelize_llama", "shard_tensor_parallel"]


def parallelize_llama(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``model`` parallelized in place on the 1-D tensor-parallel ``mesh`` by torchtitan's
    LLaMA plan: the embedding row-wise into a sequence-sharded residual stream,
    ``SequenceParallel`` norms, q/k/v and the MLP's w1/w3 column-wise (the heads split
    across the ranks), wo and w2 row-wise back into the stream, the output column-wise
    (replicated logits). A collective (DTensor's ``distribute_tensor``); returns ``model``.

    Args:
        model: A :class:`spdkfac.models.llama.Llama` (or a model of its module names).
        mesh: The tensor-parallel mesh (``mesh["tp"]`` of a 2-D one under FSDP2 × TP).
    """
    tokens = Shard(1)
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, root)
    gather = PrepareModuleInput(input_layouts=(tokens,), desired_input_layouts=(Replicate(),))
    layers = model.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList)
    for block in layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": gather,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=tokens),
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=tokens),
        }
        parallelize_module(block, mesh, plan)
    return model


#: The tensor-parallel plan of each model that has one (by its ``spdkfac train`` name).
TENSOR_PARALLEL_PLANS: dict[str, Callable[[nn.Module, DeviceMesh], nn.Module]] = {
    "llama": parallelize_llama
}


def shard_tensor_parallel(
    model: nn.Module, name: str, *, tp_size: int, device_type: str, replicas: int | None = None
) -> TorchDistributedCommunicator:
    """FSDP2 × TP for ``spdkfac train --fsdp --tp-size``: ``model`` parallelized in place by
    its plan on the ``"tp"`` dimension of a 2-D ``(dp, tp)`` mesh over the world (rank
    ``r`` at ``(r // tp_size, r % tp_size)``), then each of its ``layers`` and the root
    ``fully_shard``-ed on ``"dp"``; with ``replicas`` (``--hsdp-replicas``), HSDP × TP: the
    data-parallel ranks as a ``(replicate, shard)`` mesh of ``replicas`` rows, the whole a
    3-D ``(replicate, shard, tp)`` mesh. A collective; the process group must exist.

    Returns:
        The data-parallel communicator of this rank's ``"dp"`` group (the ranks of its
        tensor-parallel index): the tensor-parallel ranks of one group read the same batch.

    Raises:
        ValueError: ``tp_size`` does not divide the world, ``replicas`` the data-parallel
            ranks, or ``name`` has no plan.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if world % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide the world of {world}")
    plan = TENSOR_PARALLEL_PLANS.get(name.lower())
    if plan is None:
        raise ValueError(f"model {name!r} has no tensor-parallel plan")
    data_parallel = world // tp_size
    if replicas is None:
        mesh = init_device_mesh(device_type, (data_parallel, tp_size), mesh_dim_names=("dp", "tp"))
        sharding = mesh["dp"]
    elif data_parallel % replicas:
        raise ValueError(f"hsdp_replicas {replicas} does not divide {data_parallel} ranks")
    else:
        shape = (replicas, data_parallel // replicas, tp_size)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        sharding = mesh["replicate", "shard"]
    plan(model, mesh["tp"])
    layers = getattr(model, "layers", None)
    for unit in layers if isinstance(layers, nn.ModuleList) else ():
        fully_shard(unit, mesh=sharding)
    fully_shard(model, mesh=sharding)
    if replicas is None:
        return TorchDistributedCommunicator(mesh.get_group("dp"))
    # HSDP × TP: the data-parallel groups span two mesh dimensions, one group per
    # tensor-parallel index (rank r's: r % tp_size), created by every rank in the same order.
    groups = [list(range(index, world, tp_size)) for index in range(tp_size)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return TorchDistributedCommunicator(group)
