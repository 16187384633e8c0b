"""BatchNorm curvature (Osawa et al.): blocks, damped solves, intervals, state, 2 ranks, CLI."""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.cli.main import build_parser
from spdkfac.cli.train import _config_from_args
from spdkfac.layers.batchnorm import unit_inverses
from spdkfac.training.config import TrainConfig, incompatible_fields

BATCH = 6


class _Conv2dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class _LinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(5, 4)
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.bn(self.hidden(x))))


class _SequenceNet(nn.Module):
    """BatchNorm1d on ``[B, C, L]``: the positions are summed like a conv's."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.fc = nn.Linear(3 * 5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.bn(x)).flatten(1))


_INPUT_SHAPES: dict[type[nn.Module], tuple[int, ...]] = {
    _Conv2dNet: (2, 4, 4),
    _LinearNet: (5,),
    _SequenceNet: (3, 5),
}
NETS = list(_INPUT_SHAPES)


def _model(kind: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = kind().double()
    with torch.no_grad():  # a non-trivial scale and shift
        model.bn.weight.uniform_(0.5, 1.5)  # type: ignore[operator, union-attr]
        model.bn.bias.uniform_(-0.5, 0.5)  # type: ignore[operator, union-attr]
    return model


def _data(kind: type[nn.Module], step: int, batch: int = BATCH) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(batch, *_INPUT_SHAPES[kind], generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (batch,), generator=generator)


def _reference_blocks(
    model: nn.Module, inputs: Tensor, targets: Tensor, *, diagonal: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """(blocks [C, 3], ∇γ, ∇β) from explicit per-example autograd (float64).

    Example n's gradient of its own loss is its share of the batch gradient: the layers
    after the BatchNorm act on each example alone.
    """
    bn = model.bn
    assert isinstance(bn, nn.modules.batchnorm._BatchNorm)
    losses = F.cross_entropy(model(inputs), targets, reduction="none")
    scales, shifts = [], []
    for n in range(inputs.shape[0]):
        scale, shift = torch.autograd.grad(losses[n], [bn.weight, bn.bias], retain_graph=True)
        scales.append(scale)
        shifts.append(shift)
    gamma, beta = torch.stack(scales), torch.stack(shifts)
    cross = torch.zeros_like(gamma[0]) if diagonal else (gamma * beta).mean(0)
    blocks = torch.stack([(gamma * gamma).mean(0), cross, (beta * beta).mean(0)], dim=1)
    return blocks, gamma.mean(0), beta.mean(0)


def _explicit_solve(blocks: Tensor, scale: Tensor, shift: Tensor, damping: float) -> Tensor:
    """Per channel, solve (F_c + λI) v = [∇γ_c, ∇β_c] with a 2×2 matrix: [C, 2]."""
    rows = []
    for c in range(blocks.shape[0]):
        matrix = torch.tensor(
            [[blocks[c, 0] + damping, blocks[c, 1]], [blocks[c, 1], blocks[c, 2] + damping]],
            dtype=torch.float64,
        )
        rows.append(torch.linalg.solve(matrix, torch.stack([scale[c], shift[c]])))
    return torch.stack(rows)


def _bn_grads(model: nn.Module) -> Tensor:
    bn = model.bn
    assert isinstance(bn, nn.Module)
    return torch.stack([bn.weight.grad, bn.bias.grad], dim=1).clone()  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", NETS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("mode", ["unit-wise", "diagonal"])
def test_blocks_and_preconditioned_gradient_match_explicit_references(
    kind: type[nn.Module], mode: str
) -> None:
    model = _model(kind)
    reference_model = copy.deepcopy(model)  # before any hook is installed
    damping, multiplier = 0.1, 3.0
    precond = KFACPreconditioner(
        model,
        damping=damping,
        batchnorm=mode,
        batchnorm_damping_multiplier=multiplier,
        kl_clip=None,
    )
    assert precond.batchnorm_layers == ["bn"]
    inputs, targets = _data(kind, 0)
    F.cross_entropy(model(inputs), targets).backward()
    plain = _bn_grads(model)
    assert precond.step()

    blocks, scale, shift = _reference_blocks(
        reference_model, inputs, targets, diagonal=mode == "diagonal"
    )
    # The per-example shares add up to the batch gradient.
    torch.testing.assert_close(plain, torch.stack([scale, shift], dim=1), rtol=1e-10, atol=1e-12)
    fisher, inverse = precond.batchnorm_blocks("bn")
    assert fisher is not None and inverse is not None
    torch.testing.assert_close(fisher, blocks, rtol=1e-10, atol=1e-12)
    expected = _explicit_solve(blocks, scale, shift, multiplier * damping)
    torch.testing.assert_close(_bn_grads(model), expected, rtol=1e-9, atol=1e-12)


def test_refresh_intervals_running_average_and_damping_schedule() -> None:
    kind = _Conv2dNet
    model = _model(kind)
    reference_model = copy.deepcopy(model)
    precond = KFACPreconditioner(
        model,
        damping=lambda step: 0.2 / (1 + step),
        factor_decay=0.75,
        factor_update_steps=2,
        inv_update_steps=3,
        batchnorm="unit-wise",
        batchnorm_damping_multiplier=2.0,
        kl_clip=None,
    )
    references = [_reference_blocks(reference_model, *_data(kind, step))[0] for step in range(4)]
    expected = {
        0: references[0],  # the first update sets the blocks
        1: references[0],  # not a factor step
        2: 0.75 * references[0] + 0.25 * references[2],
        3: 0.75 * references[0] + 0.25 * references[2],
    }
    inverted_at = {0: 0, 1: 0, 2: 0, 3: 3}  # inverse steps 0 and 3, with that step's damping
    for step in range(4):
        model.zero_grad()
        inputs, targets = _data(kind, step)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        fisher, inverse = precond.batchnorm_blocks("bn")
        assert fisher is not None and inverse is not None
        torch.testing.assert_close(fisher, expected[step], rtol=1e-10, atol=1e-12)
        at = inverted_at[step]
        torch.testing.assert_close(
            inverse, unit_inverses(expected[at], 2.0 * 0.2 / (1 + at)), rtol=1e-10, atol=1e-12
        )


def test_kl_clip_counts_the_batchnorm_terms() -> None:
    kind, lr, kl_clip = _Conv2dNet, 0.5, 1e-6
    inputs, targets = _data(kind, 0)
    unclipped_model, clipped_model = _model(kind), _model(kind)
    options = {"damping": 0.05, "batchnorm": "unit-wise", "lr": lr}
    unclipped = KFACPreconditioner(unclipped_model, kl_clip=None, **options)  # type: ignore[arg-type]
    clipped = KFACPreconditioner(clipped_model, kl_clip=kl_clip, **options)  # type: ignore[arg-type]
    F.cross_entropy(unclipped_model(inputs), targets).backward()
    F.cross_entropy(clipped_model(inputs), targets).backward()
    raw = {n: p.grad.clone() for n, p in unclipped_model.named_parameters()}  # type: ignore[union-attr]
    assert unclipped.step() and clipped.step()
    total = sum(float((p.grad * raw[n]).sum()) for n, p in unclipped_model.named_parameters())  # type: ignore[operator]
    scale = min(1.0, math.sqrt(kl_clip / abs(lr * lr * total)))
    assert scale < 1.0
    bn_total = sum(
        float((p.grad * raw[n]).sum())  # type: ignore[operator]
        for n, p in unclipped_model.named_parameters()
        if n.startswith("bn.")
    )
    assert bn_total > 0.0  # the BatchNorm terms are part of the sum
    for name, parameter in clipped_model.named_parameters():
        expected = dict(unclipped_model.named_parameters())[name].grad * scale  # type: ignore[operator]
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-10, atol=1e-14)


def test_default_off_leaves_batchnorm_and_other_layers_alone() -> None:
    kind = _Conv2dNet
    inputs, targets = _data(kind, 0)
    plain_model = _model(kind)
    F.cross_entropy(plain_model(inputs), targets).backward()

    default_model = _model(kind)
    with pytest.warns(UserWarning, match="BatchNorm2d"):
        default = KFACPreconditioner(default_model, damping=0.05, kl_clip=None)
    assert default.batchnorm_layers == []
    with pytest.raises(KeyError):
        default.batchnorm_blocks("bn")
    F.cross_entropy(default_model(inputs), targets).backward()
    assert default.step()
    for name in ("bn.weight", "bn.bias"):
        assert torch.equal(
            dict(default_model.named_parameters())[name].grad,
            dict(plain_model.named_parameters())[name].grad,
        )
    assert set(default.state_dict()) == {
        "format",
        "steps",
        "skipped_steps",
        "forward_order",
        "inverse_form",
        "layers",
    }

    enabled_model = _model(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enabled = KFACPreconditioner(
            enabled_model, damping=0.05, kl_clip=None, batchnorm="diagonal"
        )
    assert not [w for w in caught if "BatchNorm" in str(w.message)]
    F.cross_entropy(enabled_model(inputs), targets).backward()
    assert enabled.step()
    # Without the KL clip, the Kronecker-factored layers do not see the BatchNorm blocks.
    for name, parameter in enabled_model.named_parameters():
        if not name.startswith("bn."):
            other = dict(default_model.named_parameters())[name].grad
            assert torch.equal(parameter.grad, other), name  # type: ignore[arg-type]
    assert not torch.equal(
        enabled_model.bn.weight.grad,  # type: ignore[union-attr, arg-type]
        plain_model.bn.weight.grad,  # type: ignore[union-attr, arg-type]
    )


def _setup(
    seed: int, mode: str | None = "unit-wise"
) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
    model = _model(_Conv2dNet, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        factor_update_steps=2,
        inv_update_steps=3,
        lr=0.05,
        batchnorm=mode,
        batchnorm_damping_multiplier=4.0,
    )
    return model, optimizer, precond


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, precond: KFACPreconditioner, steps: range
) -> None:
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = _data(_Conv2dNet, step)
        F.cross_entropy(model(inputs), targets).backward()
        if precond.step():
            optimizer.step()


def test_state_dict_round_trip_includes_batchnorm_blocks() -> None:
    model, optimizer, precond = _setup(0)
    _train(model, optimizer, precond, range(5))  # mid-interval for both refreshes
    state = precond.state_dict()
    assert state["batchnorm"]["mode"] == "unit-wise"
    assert tuple(state["batchnorm"]["layers"]["bn"]["fisher"].shape) == (3, 3)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict(), "kfac": state}, buffer
    )
    _train(model, optimizer, precond, range(5, 11))

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, resumed_optimizer, resumed = _setup(123)
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optim"])
    resumed.load_state_dict(saved["kfac"])
    torch.testing.assert_close(
        resumed.batchnorm_blocks("bn")[0], saved["kfac"]["batchnorm"]["layers"]["bn"]["fisher"]
    )
    _train(resumed_model, resumed_optimizer, resumed, range(5, 11))
    for (name, value), (_, other) in zip(
        model.state_dict().items(), resumed_model.state_dict().items(), strict=True
    ):
        assert torch.equal(value, other), name

    for mode in (None, "diagonal"):
        _, _, other_precond = _setup(0, mode)
        with pytest.raises(ValueError, match="BatchNorm"):
            other_precond.load_state_dict(saved["kfac"])
    _, _, enabled = _setup(0)
    _, _, disabled = _setup(0, None)
    with pytest.raises(ValueError, match="BatchNorm"):
        enabled.load_state_dict(disabled.state_dict())


def test_closed_form_inverse_of_collinear_float32_blocks() -> None:
    # u = 1000·v: the Gram determinant F_γγ·F_ββ − F_γβ² cancels to 0 (or rounds below it).
    u, v = torch.tensor([3000.0, -20.0, 7.0]), torch.tensor([3.0, -0.02, 0.0])
    blocks = torch.stack([u * u, u * v, v * v], dim=1)
    damping = 1e-3
    inverse = unit_inverses(blocks, damping)
    assert inverse.dtype == torch.float32
    for c in range(blocks.shape[0]):
        entries = blocks[c].double()
        matrix = torch.tensor(
            [[entries[0] + damping, entries[1]], [entries[1], entries[2] + damping]],
            dtype=torch.float64,
        )
        exact = torch.linalg.inv(matrix)
        torch.testing.assert_close(
            inverse[c].double(),
            torch.stack([exact[0, 0], exact[0, 1], exact[1, 1]]),
            rtol=1e-6,
            atol=0,
        )


@pytest.mark.parametrize("value", ["full", "Diagonal", "", 1, True])
def test_bad_batchnorm_mode_raises(value: object) -> None:
    with pytest.raises(ValueError, match=r"batchnorm must be one of .* got"):
        KFACPreconditioner(_model(_Conv2dNet), batchnorm=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf, "2", True, None])
def test_bad_batchnorm_damping_multiplier_raises(value: object) -> None:
    with pytest.raises(ValueError, match="batchnorm_damping_multiplier"):
        KFACPreconditioner(
            _model(_Conv2dNet),
            batchnorm="unit-wise",
            batchnorm_damping_multiplier=value,  # type: ignore[arg-type]
        )


# ---------------------------------------------------------------------- two ranks
GLOBAL_BATCH = 8


def _shard(rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
    inputs, targets = _data(_Conv2dNet, step, GLOBAL_BATCH)
    size = GLOBAL_BATCH // world_size
    return inputs[rank * size : (rank + 1) * size], targets[rank * size : (rank + 1) * size]


_OPTIONS: dict[str, object] = {
    "damping": 0.05,
    "kl_clip": 1e-2,
    "lr": 0.1,
    "batchnorm": "unit-wise",
    "batchnorm_damping_multiplier": 4.0,
}
_TRAINING: dict[str, object] = {"factor_update_steps": 2, "inv_update_steps": 3}
_STRATEGIES = ("d-kfac", "spd-kfac")
_STEPS = 6


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _two_rank_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for strategy in _STRATEGIES:
        model = DistributedDataParallel(_model(_Conv2dNet))
        precond = KFACPreconditioner(model, strategy=strategy, **_OPTIONS)  # type: ignore[arg-type]
        inputs, targets = _shard(rank, world_size, 0)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        out[f"{strategy}/grads"] = _grads(model.module)
        out[f"{strategy}/blocks"] = precond.batchnorm_blocks("bn")
        model = DistributedDataParallel(_model(_Conv2dNet))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        precond = KFACPreconditioner(model, strategy=strategy, **_OPTIONS, **_TRAINING)  # type: ignore[arg-type]
        for step in range(_STEPS):
            optimizer.zero_grad()
            inputs, targets = _shard(rank, world_size, step)
            F.cross_entropy(model(inputs), targets).backward()
            if precond.step():
                optimizer.step()
        out[f"{strategy}/params"] = {
            n: p.detach().clone() for n, p in model.module.named_parameters()
        }
    return out


def _single_process(
    world_size: int, steps: int, **extra: object
) -> tuple[nn.Module, KFACPreconditioner]:
    """One process, the shards as accumulation passes: each normalized on its own, as
    BatchNorm does on each rank of a data-parallel job."""
    model = _model(_Conv2dNet)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        accumulation_steps=world_size,
        **_OPTIONS,  # type: ignore[arg-type]
        **extra,  # type: ignore[arg-type]
    )
    for step in range(steps):
        optimizer.zero_grad()
        for rank in range(world_size):
            inputs, targets = _shard(rank, world_size, step)
            (F.cross_entropy(model(inputs), targets) / world_size).backward()
        if precond.step() and steps > 1:
            optimizer.step()
    return model, precond


def test_two_ranks_match_single_process_on_the_concatenated_batch() -> None:
    results = run_distributed(_two_rank_worker, 2, timeout=120)
    first_model, first = _single_process(2, 1)
    trained_model, _ = _single_process(2, _STEPS, **_TRAINING)
    for rank, out in enumerate(results):
        for strategy in _STRATEGIES:
            grads = out[f"{strategy}/grads"]
            assert isinstance(grads, dict)
            for name, expected in _grads(first_model).items():
                torch.testing.assert_close(
                    grads[name], expected, rtol=1e-9, atol=1e-12, msg=f"{strategy} {name} {rank}"
                )
            blocks = out[f"{strategy}/blocks"]
            assert isinstance(blocks, tuple)
            for got, expected in zip(blocks, first.batchnorm_blocks("bn"), strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
            params = out[f"{strategy}/params"]
            assert isinstance(params, dict)
            for name, expected in trained_model.named_parameters():
                torch.testing.assert_close(params[name], expected, rtol=1e-8, atol=1e-10)
                assert torch.equal(params[name], results[0][f"{strategy}/params"][name])


# ---------------------------------------------------------------------- spdkfac train
def test_train_flags_reach_the_config_and_the_compatibility_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["train", "--batchnorm", "unit-wise", "--batchnorm-damping-multiplier", "16"]
    )
    config = _config_from_args(args)
    assert (config.kfac.batchnorm, config.kfac.batchnorm_damping_multiplier) == ("unit-wise", 16.0)
    assert TrainConfig().kfac.batchnorm is None
    assert TrainConfig().to_dict()["batchnorm"] == "off"
    saved = TrainConfig().to_dict()
    assert incompatible_fields(saved, config) == ["batchnorm", "batchnorm_damping_multiplier"]
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "--batchnorm {off,diagonal,unit-wise}" in help_text
    assert "--batchnorm-damping-multiplier" in help_text


@pytest.mark.parametrize(
    "flags",
    [["--batchnorm", "full"], ["--batchnorm-damping-multiplier", "0"],
     ["--batchnorm-damping-multiplier", "x"]],
)  # fmt: skip
def test_bad_train_flags_exit_2(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        _config_from_args(build_parser().parse_args(["train", *flags]))
    assert raised.value.code == 2
    with pytest.raises(ValueError, match="batchnorm"):
        TrainConfig.from_dict({"batchnorm": "full"})
