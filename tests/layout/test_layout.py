"""The parameter-layout seam: which layout a model gets, and that the final stages read
and write gradients only through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACConfig
from spdkfac.comm import LocalCommunicator
from spdkfac.costmodel import DEFAULT_COST_MODEL
from spdkfac.curvature import discover_blocks
from spdkfac.engine.final import EngineParts, StageInputs
from spdkfac.engine.owners import OwnerStage
from spdkfac.engine.replicated import ReplicatedStage
from spdkfac.layout import DataParallelLayout, PlainLayout, layout_of
from spdkfac.planning.placement import PLACEMENT_POLICIES
from spdkfac.profiling import Profiler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_a_plain_or_compiled_model_gets_the_plain_layout() -> None:
    model = _model()
    layout = layout_of(model)
    assert isinstance(layout, PlainLayout) and layout.module is model
    assert not layout.routes_gradients and not layout.reduces_gradients
    compiled = torch.compile(model)
    assert layout_of(compiled).module is model
    with pytest.raises(ValueError, match="route"):
        layout.route_gradients(lambda state, bucket: None)
    assert layout.clip_sum(2.5) == 2.5


def test_fullgraph_compilation_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="fullgraph"):
        layout_of(torch.compile(_model(), fullgraph=True))


def _ddp_layout(rank: int, world_size: int) -> tuple[str, bool, bool, bool]:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    layout = layout_of(torch.compile(ddp))
    inner = layout_of(nn.parallel.DistributedDataParallel(torch.compile(_model())))
    return (
        layout.name,
        layout.module is model,
        isinstance(layout, DataParallelLayout) and layout.reduces_gradients,
        isinstance(inner.module, nn.Sequential),
    )


def test_ddp_through_compile_either_way_gets_the_data_parallel_layout() -> None:
    for result in run_distributed(_ddp_layout, 2):
        assert result == ("ddp", True, True, True)


class _HalvedGradients:
    """Gradients as a layout might keep them elsewhere: reads come back halved, writes
    are recorded (and stored doubled), so the test sees every access."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.writes: dict[int, Tensor] = {}

    def read(self, param: Tensor) -> Tensor | None:
        self.reads.append(id(param))
        return None if param.grad is None else param.grad / 2

    def write(self, param: Tensor, value: Tensor) -> None:
        self.writes[id(param)] = value.clone()


class _Layout(PlainLayout):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.gradients = _HalvedGradients()


@pytest.mark.parametrize("stage", [ReplicatedStage, OwnerStage])
def test_the_final_stages_read_and_write_gradients_through_the_layout(stage: type) -> None:
    model = _model()
    config = KFACConfig(lr=0.1, kl_clip=None)
    blocks = discover_blocks(model, config.skip_layers, config.block_settings)
    F.cross_entropy(model(torch.randn(5, 3, dtype=torch.float64)), torch.arange(5) % 2).backward()
    plain = {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}
    layout = _Layout(model)
    specs = [spec for block in blocks for spec in block.inverse_specs()]
    plan = PLACEMENT_POLICIES["layer-owners"].plan(specs, 1, DEFAULT_COST_MODEL)
    parts = EngineParts(blocks, LocalCommunicator(), layout, DEFAULT_COST_MODEL, Profiler(), bool)
    inputs = StageInputs(parts, plan)
    final = stage(inputs)
    gradients, usable = final.collect()
    assert usable and set(layout.gradients.reads) == set(plain)
    for block in blocks:
        weight = block.module.weight
        torch.testing.assert_close(gradients[block.name][:, : weight[0].numel()],
                                   plain[id(weight)].reshape(weight.shape[0], -1) / 2)  # fmt: skip
    assert final.apply(gradients, {b.name: 0.1 for b in blocks}, None, usable)
    # No inverses yet: the update is the plain (halved) gradient, written through the
    # layout and never into .grad directly.
    assert set(layout.gradients.writes) == set(plain)
    for key, value in layout.gradients.writes.items():
        torch.testing.assert_close(value, plain[key] / 2)
    assert all(torch.equal(p.grad, plain[id(p)]) for p in model.parameters())
