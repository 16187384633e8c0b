"""Record what K-FAC computes on a fixed matrix of models, strategies and world sizes, or
compare two such records (the check that a refactor changed no number).

Usage:
    PYTHONPATH=<checkout>/src python scripts/same_numbers.py record OUT.pt
    python scripts/same_numbers.py compare A.pt B.pt

Each case trains a small model for a few steps (float64, gloo ranks forked on this host
for world sizes above 1, DDP averaging the gradients) and records its parameters and the
preconditioner's factors and inverses on rank 0. Only the public API is used, so any
checkout records the same cases.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from spdkfac import KFACPreconditioner
from spdkfac.models.gpt import GPT

STEPS = 4
CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    (model, strategy, world, options)
    for model in ("mlp", "cnn", "gpt")
    for strategy in ("d-kfac", "mpd-kfac", "spd-kfac", "osawa")
    for world in (1, 2, 3)
    for options in ({},)
] + [
    ("cnn", "osawa", 2, {"factor_exchange": "optimal"}),
    ("gpt", "osawa", 3, {"factor_exchange": "optimal", "comm_scheduler": "priority"}),
    ("mlp", "auto", 2, {"auto_trial_steps": 1, "auto_rounds": 1}),
    ("cnn", "spd-kfac", 2, {"comm_scheduler": "priority"}),
    ("mlp", "spd-kfac", 2, {"inverse_method": "eigen-basis"}),
    ("gpt", "spd-kfac", 3, {"inverse_method": "eigen-basis"}),
    ("cnn", "spd-kfac", 2, {"factor_update_steps": 2, "inv_update_steps": 3}),
    ("gpt", "d-kfac", 2, {"weight_sharing": "reduce"}),
]


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, groups=2),
            nn.Flatten(),
            nn.Linear(4 * 6 * 6, 5),
        ).double()
    return GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16).double()


def _batch(kind: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    if kind == "mlp":
        return torch.randn(8, 6, generator=generator, dtype=torch.float64), torch.arange(8) % 4
    if kind == "cnn":
        inputs = torch.randn(4, 3, 8, 8, generator=generator, dtype=torch.float64)
        return inputs, torch.arange(4) % 5
    tokens = torch.randint(0, 32, (3, 9), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(kind: str, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
    out = model(inputs)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _run_case(rank: int, world: int, case: tuple[str, str, int, dict[str, Any]]) -> dict:
    kind, strategy, _, options = case
    model = _model(kind)
    wrapped = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    normalization = {"cnn": "unit-wise", "gpt": "diagonal"}.get(kind)
    # Every option that matters is given, so a change of defaults changes no case.
    chosen = {"factor_update_steps": 1, "inv_update_steps": 1, "kl_clip": 0.001, **options}
    precond = KFACPreconditioner(
        wrapped,
        strategy=strategy,
        optimizer=optimizer,
        damping=0.01,
        factor_decay=0.95,
        normalization=normalization,
        **chosen,
    )
    for step in range(STEPS):
        inputs, targets = _batch(kind, rank * STEPS + step)
        optimizer.zero_grad()
        _loss(kind, wrapped, inputs, targets).backward()
        if precond.step():
            optimizer.step()
    state = precond.state_dict()
    precond.remove()
    record = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for section in ("layers",):
        for name, entry in state[section].items():
            for key, value in entry.items():
                if value is not None:
                    record[f"{section}/{name}/{key}"] = value
    return record


def _worker(rank: int, world: int, port: int, case: Any, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        record = _run_case(rank, world, case)
        if rank == 0:
            torch.save(record, path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def record_all(out: str) -> None:
    """Run every case and save ``{case name: record}`` to ``out``."""
    torch.set_num_threads(1)
    results = {}
    context = mp.get_context("fork")
    for case in CASES:
        kind, strategy, world, options = case
        name = f"{kind} {strategy} world={world} {options}"
        if world == 1:
            results[name] = _run_case(0, 1, case)
        else:
            path = f"{out}.rank0"
            port = _free_port()
            procs = [
                context.Process(target=_worker, args=(r, world, port, case, path))
                for r in range(world)
            ]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(timeout=120)
                if proc.is_alive():
                    proc.kill()
            if any(proc.exitcode != 0 for proc in procs):
                raise RuntimeError(f"{name}: a rank failed")
            results[name] = torch.load(path)
            os.remove(path)
        print(name, "recorded", flush=True)
    torch.save(results, out)


def compare(first: str, second: str) -> int:
    """Print, per case, whether the two records are bitwise equal (else the largest
    difference); 1 when any differs."""
    a, b = torch.load(first), torch.load(second)
    differing = 0
    for name in a:
        left, right = a[name], b.get(name)
        if right is None or set(left) != set(right):
            print(f"{name}: different entries")
            differing += 1
            continue
        worst = max(float((left[k] - right[k]).abs().max()) for k in left)
        equal = all(torch.equal(left[k], right[k]) for k in left)
        differing += not equal
        print(f"{name}: {'bitwise equal' if equal else f'max |diff| {worst:.3e}'}")
    print(f"{len(a) - differing} of {len(a)} cases bitwise equal")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record").add_argument("out")
    both = sub.add_parser("compare")
    both.add_argument("first")
    both.add_argument("second")
    args = parser.parse_args()
    if args.command == "record":
        record_all(args.out)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
