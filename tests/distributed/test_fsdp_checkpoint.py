"""The preconditioner's state through ``torch.distributed.checkpoint`` (DCP): saved at
world 2 under FSDP2 (d-kfac, spd-kfac, osawa: each rank writes the layers it holds), loaded
into fresh preconditioners under FSDP2 and DDP at worlds 2 and 4 and a plain model at 1,
factors and inverses bit for bit, training continuing as the uninterrupted run; a DCP state
of another model is refused."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from distributed_helper import run_distributed
from fsdp_cases import (
    OPTIONS,
    STRATEGIES,
    conv_net,
    full_params,
    global_part,
    gpt,
    gpt_batch,
    shard,
)
from parallel_cases import batch, bounds
from spdkfac import KFACPreconditioner

#: Saved at world 2 besides the strategies' ConvNet runs: the GPT (tied head, LayerNorm
#: blocks in the normalization section) under osawa. Its position embedding sees
#: ``arange(T)``, not the batch, so it cannot resume at another world size: left out.
GPT = {"normalization": "unit-wise", "skip_layers": ("pos_emb",)}
SAVED_AT = 3  # steps before the checkpoint
MORE = 2  # steps after it


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Plain SGD: no optimizer state, so the model and the preconditioner are the run."""
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: nn.Module, step: int, part: tuple[int, int], kind: str) -> Tensor:
    begin, end = part
    if kind == "gpt":
        tokens, targets = gpt_batch(step)
        logits = model(tokens[begin:end])
        return F.cross_entropy(logits.reshape(-1, 11), targets[begin:end].reshape(-1))
    images, labels = batch(step)
    return F.cross_entropy(model(images[begin:end]), labels[begin:end])


def _steps(
    model: nn.Module,
    precond: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    steps: range,
    part: tuple[int, int],
    kind: str = "conv",
) -> None:
    for step in steps:
        optimizer.zero_grad()
        _loss(model, step, part, kind).backward()
        assert precond.step()
        optimizer.step()


def _save(model: nn.Module, precond: KFACPreconditioner, path: str) -> None:
    dcp.save({"model": model.state_dict(), "kfac": precond.dcp_state_dict()}, checkpoint_id=path)


def _load(model: nn.Module, precond: KFACPreconditioner, path: str) -> None:
    """The documented resume: fresh templates, ``dcp.load`` fills them, then load each."""
    inner = getattr(model, "module", model)  # DDP's names without "module."
    state = {"model": inner.state_dict(), "kfac": precond.dcp_state_dict()}
    dcp.load(state, checkpoint_id=path)
    inner.load_state_dict(state["model"])
    precond.load_dcp_state_dict(state["kfac"])


def _cases() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(name, model, strategy, options) of every saved run."""
    conv = [(strategy, "conv", strategy, OPTIONS) for strategy in STRATEGIES]
    return [*conv, ("gpt/osawa", "gpt", "osawa", {**OPTIONS, **GPT})]


_MODELS = {"conv": conv_net, "gpt": gpt}


def _save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per case: train, save, keep training (the uninterrupted run)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for name, kind, strategy, options in _cases():
        model = shard(_MODELS[kind](), mesh)
        optimizer = _sgd(model)
        precond = KFACPreconditioner(model, optimizer=optimizer, strategy=strategy, **options)
        part = global_part(kind, rank, world_size)
        _steps(model, precond, optimizer, range(SAVED_AT), part, kind)
        _save(model, precond, os.path.join(root, name))
        held = set(precond.dcp_state_dict()["layers"])
        saved = precond.state_dict()  # the full state (osawa: gathered), to compare with
        _steps(model, precond, optimizer, range(SAVED_AT, SAVED_AT + MORE), part, kind)
        out[name] = {"held": held, "saved": saved, "final": full_params(model)}
    return out


def _resumed(
    model: nn.Module,
    strategy: str,
    path: str,
    part: tuple[int, int],
    kind: str = "conv",
    options: Mapping[str, Any] = OPTIONS,
) -> Any:
    optimizer = _sgd(model)
    precond = KFACPreconditioner(model, optimizer=optimizer, strategy=strategy, **options)
    _load(model, precond, path)
    loaded = precond.state_dict()
    _steps(model, precond, optimizer, range(SAVED_AT, SAVED_AT + MORE), part, kind)
    return {"loaded": loaded, "final": full_params(getattr(model, "module", model))}


def _resume_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per strategy saved at world 2: resume under FSDP2 (the same strategy) and under DDP
    (spd-kfac) at ``world_size``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world_size,))
    part = bounds(rank, world_size)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        path = os.path.join(root, strategy)
        out[f"fsdp/{strategy}"] = _resumed(shard(conv_net(), mesh), strategy, path, part)
        ddp = DistributedDataParallel(conv_net())
        out[f"ddp/{strategy}"] = _resumed(ddp, "spd-kfac", path, part)
    return out


def _assert_same_state(loaded: Mapping[str, Any], saved: Mapping[str, Any], label: str) -> None:
    """Counters, forward order and every factor and inverse, bit for bit (None as None),
    of the Kronecker layers and of the normalization section (when there is one)."""
    for key in ("steps", "skipped_steps", "forward_order", "inverse_form"):
        assert loaded[key] == saved[key], f"{label} {key}"
    assert ("batchnorm" in loaded) == ("batchnorm" in saved), label
    sections = [(loaded["layers"], saved["layers"])]
    if "batchnorm" in saved:
        assert loaded["batchnorm"]["mode"] == saved["batchnorm"]["mode"], label
        sections.append((loaded["batchnorm"]["layers"], saved["batchnorm"]["layers"]))
    for got_layers, layers in sections:
        assert set(got_layers) == set(layers), label
        for name, entry in layers.items():
            for key, value in entry.items():
                got = got_layers[name][key]
                assert (got is None) == (value is None), f"{label} {name} {key}"
                if value is not None:
                    assert got.dtype == value.dtype, f"{label} {name} {key}"
                    assert torch.equal(got, value), f"{label} {name} {key}"


def _assert_close(final: Mapping[str, Tensor], expected: Mapping[str, Tensor], label: str) -> None:
    assert set(final) == set(expected), label
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-8, atol=1e-10, msg=f"{label} {name}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, run_distributed(_save_worker, 2, root, timeout=240)


def _files_by_layer(path: str) -> dict[str, set[str]]:
    """The checkpoint files each layer's tensors were written to (from DCP's metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    files: dict[str, set[str]] = {}
    for index, info in FileSystemReader(path).read_metadata().storage_data.items():
        if index.fqn.startswith("kfac.layers."):
            files.setdefault(index.fqn.split(".")[2], set()).add(info.relative_path)
    return files


def test_osawa_ranks_write_only_the_layers_they_hold(saved: Any) -> None:
    root, results = saved
    # Each owner wrote its own layers into its own file; nothing went through rank 0.
    files = _files_by_layer(os.path.join(root, "osawa"))
    for rank, out in enumerate(results):
        for name in out["osawa"]["held"] - results[1 - rank]["osawa"]["held"]:
            assert files[name] == {f"__{rank}_0.distcp"}, (rank, name, files[name])
    every = set(results[0]["d-kfac"]["saved"]["layers"])
    assert results[0]["d-kfac"]["held"] == results[1]["d-kfac"]["held"] == every
    owned = [out["osawa"]["held"] for out in results]
    assert owned[0] and owned[1] and owned[0] != every and owned[1] != every
    assert owned[0] | owned[1] == every
    some = results[0]["osawa"]["saved"]["layers"]
    assert any(v is not None for entry in some.values() for v in entry.values())
    gpt_state = results[0]["gpt/osawa"]["saved"]
    assert gpt_state["batchnorm"]["layers"] and "head" in gpt_state["layers"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_resume_at_world_2_and_4_under_fsdp2_and_ddp(saved: Any, world_size: int) -> None:
    root, results = saved
    resumed = run_distributed(_resume_worker, world_size, root, timeout=240)
    for rank, out in enumerate(resumed):
        for strategy in STRATEGIES:
            uninterrupted = results[rank % 2][strategy]
            for kind in ("fsdp", "ddp"):
                got = out[f"{kind}/{strategy}"]
                label = f"{strategy} -> {kind} rank {rank}"
                _assert_same_state(got["loaded"], uninterrupted["saved"], label)
                _assert_close(got["final"], uninterrupted["final"], label)


@pytest.mark.parametrize("case", [case[0] for case in _cases()])
def test_resume_at_world_1_on_a_plain_model(saved: Any, case: str) -> None:
    root, results = saved
    _, kind, _, options = next(c for c in _cases() if c[0] == case)
    path = os.path.join(root, case)
    with pytest.warns(UserWarning, match="single process"):
        got = _resumed(_MODELS[kind](), "d-kfac", path, global_part(kind, 0, 1), kind, options)
    _assert_same_state(got["loaded"], results[0][case]["saved"], case)
    _assert_close(got["final"], results[0][case]["final"], case)


class _Other(nn.Module):
    """Layers of other names than :func:`conv_net`'s."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_state_of_another_model_is_refused(saved: Any) -> None:
    root, _ = saved
    path = os.path.join(root, "d-kfac")
    # Fewer layers: DCP reads the ones asked for, the signature says the rest differ.
    fewer = KFACPreconditioner(conv_net(), skip_layers=("fc2",), lr=0.1, **OPTIONS)
    state = {"kfac": fewer.dcp_state_dict()}
    dcp.load(state, checkpoint_id=path)
    with pytest.raises(ValueError, match=r"another model: .*unexpected \['layers/fc2'\]"):
        fewer.load_dcp_state_dict(state["kfac"])
    assert fewer.steps == 0
    # Other names: DCP itself names the missing key, or with a partial load we do.
    other = KFACPreconditioner(_Other(), lr=0.1, **OPTIONS)
    state = {"kfac": other.dcp_state_dict()}
    with pytest.raises(CheckpointException, match=r"Missing key .*kfac\.layers\.head"):
        dcp.load(state, checkpoint_id=path)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    dcp.load(state, checkpoint_id=path, planner=planner)
    with pytest.raises(ValueError, match=r"missing from it \['layers/head'\]"):
        other.load_dcp_state_dict(state["kfac"])
    with pytest.raises(ValueError, match="not a preconditioner's DCP state"):
        other.load_dcp_state_dict({"layers": {}})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_float32_state_and_missing_entries_round_trip(tmp_path: Any) -> None:
    """float32 factors come back float32 and bit for bit through the float64 template;
    entries never computed, or left out (``inverses=False``), come back None, and the
    inverses are then recomputed as after :meth:`load_state_dict`."""
    model = conv_net().float()
    optimizer = _sgd(model)
    precond = KFACPreconditioner(model, optimizer=optimizer, **OPTIONS)
    fresh = str(tmp_path / "fresh")
    dcp.save({"kfac": precond.dcp_state_dict()}, checkpoint_id=fresh)
    for step in range(SAVED_AT):
        optimizer.zero_grad()
        images, labels = batch(step)
        F.cross_entropy(model(images.float()), labels).backward()
        precond.step()
        optimizer.step()
    path = str(tmp_path / "no-inverses")
    dcp.save({"kfac": precond.dcp_state_dict(inverses=False)}, checkpoint_id=path)
    for where, expected in ((path, precond.state_dict(inverses=False)), (fresh, None)):
        other_model = conv_net().float()
        other = KFACPreconditioner(other_model, lr=0.1, **OPTIONS)
        state = {"kfac": other.dcp_state_dict()}
        dcp.load(state, checkpoint_id=where)
        other.load_dcp_state_dict(state["kfac"])
        loaded = other.state_dict()
        if expected is None:  # saved before any step: nothing
            assert loaded["steps"] == 0
            assert all(v is None for e in loaded["layers"].values() for v in e.values())
            continue
        _assert_same_state(loaded, expected, "float32")
        assert loaded["layers"]["fc1"]["a_factor"].dtype == torch.float32
        assert loaded["layers"]["fc1"]["a_inverse"] is None
        images, labels = batch(SAVED_AT)  # step 3: not an inverse step, yet recomputed
        F.cross_entropy(other_model(images.float()), labels).backward()
        assert other.step() and other.inverses("fc1")[0] is not None
