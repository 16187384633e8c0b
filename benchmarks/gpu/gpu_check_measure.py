"""The measurements of ``benchmarks/gpu/gpu_check.sh``: factor kernels against ``torch.mm``, the
inverse cost model, training steps and the simulator's device constants, on one device.

Each function returns plain data (JSON-ready); :mod:`gpu_check` runs them, writes the files
and the report. Sizes come from a :class:`Sizes` (full on a GPU, tiny for ``--dry-run``).
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.calibrate import CalibrationPlan, FactorWorkload, calibrate
from spdkfac.calibrate.timing import median_seconds, synchronize
from spdkfac.comm import LocalCommunicator
from spdkfac.costmodel import CalibrationFile, factor_flops
from spdkfac.layers import FactorOptions, lookup
from spdkfac.models import GPT, build_model
from spdkfac.sim import trace_workload
from spdkfac.sim.calibration import fit_device_model

# The simulator's CPU calibration probe (benchmarks/sim/calibrate_sim_cpu.py), timed here too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from calibrate_sim_cpu import probe_net


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is."""

    image_model: str  # a spdkfac.models name
    image_size: int
    image_batch: int
    gpt: dict[str, int]  # GPT(**gpt)
    gpt_batch: int
    peak_side: int  # the square matmul giving the roofline
    inverse_dims: tuple[int, ...]
    inverse_seconds: float
    repeats: int
    plain_steps: int
    every_step: int  # timed steps of K-FAC 1/1
    amortized: tuple[int, int]  # (factor_update_steps, inv_update_steps)
    sim_shapes: tuple[tuple[int, int], ...]  # (channels, image side) of the traced nets
    sim_batch: int


FULL = Sizes(
    image_model="resnet50", image_size=224, image_batch=32,
    gpt={"vocab_size": 256, "block_size": 256, "n_layer": 6, "n_head": 12, "d_model": 768},
    gpt_batch=16, peak_side=8192, inverse_dims=(64, 128, 256, 512, 1024, 2048, 3072, 4096, 4608),
    inverse_seconds=60.0, repeats=5, plain_steps=30, every_step=10, amortized=(10, 100),
    sim_shapes=((64, 56), (128, 28), (256, 14), (512, 7), (64, 112), (256, 28)), sim_batch=32,
)  # fmt: skip
DRY = Sizes(
    image_model="resnet20", image_size=8, image_batch=2,
    gpt={"vocab_size": 17, "block_size": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
    gpt_batch=2, peak_side=128, inverse_dims=(8, 16, 32), inverse_seconds=3.0, repeats=2,
    plain_steps=2, every_step=2, amortized=(2, 4), sim_shapes=((8, 8), (16, 4)), sim_batch=2,
)  # fmt: skip


class DeviceCommunicator(LocalCommunicator):
    """A group of one whose tensors live on ``device`` (``calibrate`` times there)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    @property
    def device(self) -> torch.device:
        return self._device


def _image_model(sizes: Sizes, device: torch.device) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    classes = 1000 if sizes.image_size >= 224 else 10
    model = build_model(sizes.image_model, num_classes=classes, in_channels=3,
                        input_size=sizes.image_size).to(device)  # fmt: skip
    inputs = torch.randn(sizes.image_batch, 3, sizes.image_size, sizes.image_size, device=device)
    return model, inputs, torch.randint(0, classes, (sizes.image_batch,), device=device)


def _gpt_model(sizes: Sizes, device: torch.device) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    model = GPT(**sizes.gpt).to(device)
    shape = (sizes.gpt_batch, sizes.gpt["block_size"] + 1)
    tokens = torch.randint(0, sizes.gpt["vocab_size"], shape, device=device)
    return model, tokens[:, :-1], tokens[:, 1:]


MODELS: dict[str, Callable[[Sizes, torch.device], tuple[nn.Module, Tensor, Tensor]]] = {
    "image": _image_model,
    "gpt": _gpt_model,
}


def label(model_name: str, sizes: Sizes) -> str:
    """The name a report gives a :data:`MODELS` entry."""
    return sizes.image_model if model_name == "image" else "gpt"


def _loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def peak_matmul(sizes: Sizes, device: torch.device) -> dict[str, float]:
    """FLOP/s of a square ``torch.mm`` per dtype: the roofline factor kernels are held to."""
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        side = sizes.peak_side
        a = torch.randn(side, side, device=device, dtype=dtype)
        seconds = median_seconds(lambda a=a: torch.mm(a, a), sizes.repeats, device)
        rates[name] = 2.0 * side**3 / seconds
    return rates


def _captured(model: nn.Module, inputs: Tensor, targets: Tensor) -> dict[str, dict[str, Any]]:
    """Each K-FAC layer's module, input and output gradient from one pass."""
    store: dict[str, dict[str, Any]] = {}
    handles = []
    for name, module in model.named_modules():
        if lookup(module) is None:
            continue

        def forward(mod: nn.Module, args: tuple[Any, ...], out: Tensor, name: str = name) -> None:
            store[name] = {"module": mod, "x": args[0].detach()}
            out.register_hook(lambda grad: store[name].__setitem__("g", grad.detach()))

        handles.append(module.register_forward_hook(forward))
    _loss(model, inputs, targets).backward()
    for handle in handles:
        handle.remove()
    return {name: entry for name, entry in store.items() if "g" in entry}


def _layer_kernels(
    module: nn.Module, entry: dict[str, Any], sizes: Sizes, device: torch.device
) -> list[dict[str, Any]]:
    """One layer's A and G kernels in float32 and bf16 compute, and ``torch.mm`` of the
    same ``[rows, dim]`` shapes in the same dtype (seconds, ``factor_flops`` of each)."""
    base = lookup(module)
    assert base is not None
    rows = _rows(module, entry["g"])
    found = []
    for dtype_name, dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        adapter = base.with_options(FactorOptions(compute_dtype=dtype))
        kernels = [("G", adapter.g_factor, entry["g"], adapter.g_dim(module))]
        if not isinstance(module, nn.Embedding):  # an embedding's A is a count, no product
            kernels.insert(0, ("A", adapter.a_factor, entry["x"], adapter.a_dim(module)))
        for kind, compute, tensor, dim in kernels:
            seconds = median_seconds(
                lambda c=compute, t=tensor: c(module, t), sizes.repeats, device
            )
            x = torch.randn(rows, dim, device=device, dtype=dtype or torch.float32)
            mm = median_seconds(lambda x=x: torch.mm(x.T, x), sizes.repeats, device)
            found.append({"kind": kind, "dtype": dtype_name, "rows": rows, "dim": dim,
                          "flops": factor_flops(rows, dim), "seconds": seconds,
                          "mm_seconds": mm})  # fmt: skip
    return found


def factor_kernels(
    sizes: Sizes, device: torch.device, peaks: dict[str, float]
) -> list[dict[str, Any]]:
    """Per layer of both models, factor, and compute dtype: seconds of spdkfac's factor
    kernel and of ``torch.mm`` of the same shape, and each one's share of the
    square-matmul roofline (``factor_flops / seconds / peak``)."""
    rows = []
    for model_name, build in MODELS.items():
        model, inputs, targets = build(sizes, device)
        for layer, entry in _captured(model, inputs, targets).items():
            for row in _layer_kernels(entry["module"], entry, sizes, device):
                peak = peaks[row["dtype"]]
                row["share_of_peak"] = row["flops"] / row["seconds"] / peak
                row["mm_share_of_peak"] = row["flops"] / row["mm_seconds"] / peak
                rows.append({"model": label(model_name, sizes), "layer": layer, **row})
        del model
    return rows


def _rows(module: nn.Module, grad_output: Tensor) -> int:
    """Rows of a layer's factor products ``XᵀX``: one per output position (a convolution's
    patches, a sequence's tokens)."""
    channels = 1 if isinstance(module, (nn.Conv1d, nn.Conv2d)) else -1
    return grad_output.numel() // grad_output.shape[channels]


def inverse_cost_model(sizes: Sizes, device: torch.device) -> CalibrationFile:
    """``spdkfac calibrate`` on the device: damped inverses by size and the factor products
    of the image model, fitted and kept with their samples."""
    model, inputs, targets = _image_model(sizes, device)
    plan = CalibrationPlan(dims=sizes.inverse_dims, sizes_bytes=(), repeats=sizes.repeats,
                           max_seconds=sizes.inverse_seconds)  # fmt: skip
    return calibrate(
        DeviceCommunicator(device),
        plan,
        factors=FactorWorkload(model, (inputs, targets)),
        extra_metadata={"model": sizes.image_model, "batch_size": sizes.image_batch},
    )


def _step_seconds(model_name: str, sizes: Sizes, device: torch.device, kfac: dict | None,
                  steps: int) -> list[float]:  # fmt: skip
    """Seconds of each of ``steps`` training steps after the first (untimed) one."""
    model, inputs, targets = MODELS[model_name](sizes, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with warnings.catch_warnings():  # LayerNorm / BatchNorm keep their plain gradient
        warnings.filterwarnings("ignore", "spdkfac: these layers are not preconditioned")
        precond = None if kfac is None else KFACPreconditioner(model, optimizer=optimizer, **kfac)
    times = []
    for index in range(steps + 1):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        _loss(model, inputs, targets).backward()
        if precond is None or precond.step():
            optimizer.step()
        synchronize(device)
        if index > 0:
            times.append(time.perf_counter() - start)
    return times


def training_steps(sizes: Sizes, device: torch.device) -> list[dict[str, Any]]:
    """Plain SGD, K-FAC every step, and K-FAC amortized (its mean over one whole inverse
    interval, so each expensive step counts once), for both models."""
    factor_every, inverse_every = sizes.amortized
    variants: list[tuple[str, dict | None, int]] = [
        ("plain", None, sizes.plain_steps),
        ("kfac 1/1", {"factor_update_steps": 1, "inv_update_steps": 1}, sizes.every_step),
        (f"kfac {factor_every}/{inverse_every}",
         {"factor_update_steps": factor_every, "inv_update_steps": inverse_every},
         inverse_every),
    ]  # fmt: skip
    results = []
    for model_name in MODELS:
        for variant, kfac, steps in variants:
            times = _step_seconds(model_name, sizes, device, kfac, steps)
            results.append({"model": label(model_name, sizes), "variant": variant,
                            "steps": len(times),
                            "mean_seconds": statistics.fmean(times),
                            "median_seconds": statistics.median(times)})  # fmt: skip
    return results


def sim_device_model(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    """The simulator's ``DeviceModel`` fitted to timed ops of small conv nets on the device
    (``spdkfac.sim.fit_device_model``, as ``benchmarks/sim/calibrate_sim_cpu.py`` on the CPU)."""
    ops = []
    for channels, side in sizes.sim_shapes:
        torch.manual_seed(0)
        workload = trace_workload(probe_net(channels), (channels, side, side),
                                  batch_size=sizes.sim_batch, device=device,
                                  repeats=sizes.repeats)  # fmt: skip
        ops += workload.ops()
    model, errors = fit_device_model(ops)
    return {
        "gemm_flops_per_second": model.gemm_flops_per_second,
        "gemm_half_side": model.gemm_half_side,
        "memory_bytes_per_second": model.memory_bytes_per_second,
        "op_overhead_seconds": model.op_overhead_seconds,
        "op_scale": dict(model.op_scale),
        "fit_errors": errors,
        "ops": len(ops),
    }
