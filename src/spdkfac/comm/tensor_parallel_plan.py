"""torchtitan's tensor-parallel plan for the LLaMA layout (:mod:`spdkfac.models.llama`),
applied with DTensor's ``parallelize_module`` (``torch.distributed`` APIs, hence here)."""

from __future__ import annotations

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

__all__ = ["parallelize_llama"]


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
