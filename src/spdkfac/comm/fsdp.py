"""FSDP2 wrapping for ``spdkfac train --fsdp``: ``fully_shard`` a model's units and root on
a 1-D mesh over the world (``torch.distributed`` APIs, hence here)."""

from __future__ import annotations

from torch import nn

__all__ = ["fully_shard_model", "shard_units"]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as FSDP2 groups of their own: the model's ``blocks`` when it
    has an ``nn.ModuleList`` of them (the GPT: its tied embedding and head stay in the
    root's group), otherwise every direct child that holds parameters."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return [child for child in model.children() if any(True for _ in child.parameters())]


def fully_shard_model(
    model: nn.Module, *, world_size: int, device_type: str, replicas: int | None = None
) -> nn.Module:
    """``fully_shard`` each of :func:`shard_units`, then ``model`` itself, on a 1-D mesh of
    ``world_size`` ranks, or with ``replicas`` (HSDP) on a 2-D mesh of ``replicas`` ×
    ``world_size // replicas`` (replicate × shard). A collective; the process group must
    exist. Returns ``model``, sharded in place: its parameters are DTensors afterwards.

    Raises:
        ValueError: ``replicas`` does not divide ``world_size``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if replicas is None:
        mesh = init_device_mesh(device_type, (world_size,))
    else:
        if world_size % replicas:
            raise ValueError(f"hsdp_replicas {replicas} does not divide the world of {world_size}")
        shape = (replicas, world_size // replicas)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
