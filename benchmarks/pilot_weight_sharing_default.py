"""Pilot for issue 42's defaults question: should convolutions reduce by default?

K-FAC-reduce (Eschenhagen et al., NeurIPS 2023, Sec. 3) builds a convolution's A factor
from each example's *mean* patch, expand from every patch. Where patches vary around a
small mean (zero-mean inputs), reduce's A is much smaller than expand's, so the same
damping weighs more against it; where the head sees every position (a flattened feature
map, no global pooling), the positions' gradients are not summed by the model either.
This pilot measures what that does at the library's default damping, on two small CNNs
over 8x8 single-channel inputs labelled by a random teacher:

* ``flatten``: conv-ReLU-conv-ReLU-flatten-linear (the head sees every position);
* ``pooled``: the same convolutions, global average pooling, linear;

each on zero-mean inputs and on the same inputs shifted by +1 (mean patches away from 0).
Every cell is one 60-step run (batch 64, SGD momentum 0.9, inverses every step, KL clip
0.01), final training loss on all 256 examples; damping {0.03, 0.1, 0.3} x learning rate
{0.01, 0.03, 0.1} for each of expand and reduce, and SGD's best over {0.01, 0.03, 0.1, 0.3}.

Declared before its first run; the output is printed whole (every run):
``python benchmarks/pilot_weight_sharing_default.py > out.txt``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner

STEPS, BATCH, EXAMPLES = 60, 64, 256
DAMPINGS = (0.03, 0.1, 0.3)
KFAC_LRS = (0.01, 0.03, 0.1)
SGD_LRS = (0.01, 0.03, 0.1, 0.3)
DEFAULT_DAMPING = 0.1  # KFACConfig's default


def _model(head: str) -> nn.Module:
    torch.manual_seed(0)
    convs = [nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()]
    if head == "flatten":
        return nn.Sequential(*convs, nn.Flatten(), nn.Linear(8 * 64, 4))
    return nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _data(offset: float) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(EXAMPLES, 1, 8, 8, generator=generator) + offset
    teacher = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 4))
    torch.manual_seed(1)
    for parameter in teacher.parameters():
        nn.init.normal_(parameter, std=1.0)
    with torch.no_grad():
        return inputs, teacher(inputs - offset).argmax(1)


def _final_loss(
    head: str, data: tuple[Tensor, Tensor], lr: float, sharing: str | None, damping: float
) -> float:
    inputs, targets = data
    model = _model(head)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precond = None
    if sharing is not None:
        precond = KFACPreconditioner(
            model, lr=lr, damping=damping, kl_clip=0.01, inv_update_steps=1,
            weight_sharing=sharing,
        )  # fmt: skip
    for step in range(STEPS):
        start = (step * BATCH) % EXAMPLES
        optimizer.zero_grad()
        batch = slice(start, start + BATCH)
        F.cross_entropy(model(inputs[batch]), targets[batch]).backward()
        if precond is None or precond.step():
            optimizer.step()
    with torch.no_grad():
        loss = float(F.cross_entropy(model(inputs), targets))
    return loss if loss == loss else float("inf")  # NaN: diverged


def _by_lr(losses: dict[float, float]) -> str:
    return ", ".join(f"{lr:g}: {loss:.4f}" for lr, loss in losses.items())


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; final training loss after {STEPS} steps (lower is better)")
    summary = []
    for head, offset in itertools.product(("flatten", "pooled"), (0.0, 1.0)):
        data = _data(offset)
        case = f"{head}, input mean {offset:g}"
        sgd = {lr: _final_loss(head, data, lr, None, 0.0) for lr in SGD_LRS}
        print(f"\n{case}: SGD by lr {_by_lr(sgd)}")
        best = {}
        for sharing in ("expand", "reduce"):
            for damping in DAMPINGS:
                losses = {lr: _final_loss(head, data, lr, sharing, damping) for lr in KFAC_LRS}
                print(f"  {sharing:6s} damping {damping:<4g} by lr {_by_lr(losses)}")
                best[(sharing, damping)] = min(losses.values())
        line = [f"{case}: best SGD {min(sgd.values()):.4f}"]
        for sharing in ("expand", "reduce"):
            default = best[(sharing, DEFAULT_DAMPING)]
            overall = min(v for (s, _), v in best.items() if s == sharing)
            line.append(
                f"{sharing} at damping {DEFAULT_DAMPING:g} {default:.4f} "
                f"(any damping {overall:.4f})"
            )
        summary.append("; ".join(line))
    print("\nBest over learning rates:")
    for case_line in summary:
        print(f"  {case_line}")


if __name__ == "__main__":
    main()
