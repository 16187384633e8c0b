"""Independent float64 references: explicit per-example loops and explicit Kronecker solves."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def output_grad(layer_output: Tensor, loss_fn: Callable[[Tensor], Tensor]) -> Tensor:
    """∂ loss_fn(y) / ∂y at y = layer_output (a leaf copy), for one example's own loss."""
    leaf = layer_output.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss_fn(leaf), leaf)
    return grad


def explicit_conv_patches(
    x: Tensor,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> list[list[Tensor]]:
    """For each example, the list of patch vectors (C·kh·kw, channel-major) by explicit loops."""
    batch, channels, height, width = x.shape
    kh, kw = kernel
    padded = torch.zeros(
        batch, channels, height + 2 * padding[0], width + 2 * padding[1], dtype=x.dtype
    )
    padded[:, :, padding[0] : padding[0] + height, padding[1] : padding[1] + width] = x
    out_h = (height + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    out_w = (width + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    result = []
    for n in range(batch):
        patches = []
        for i in range(out_h):
            for j in range(out_w):
                vector = []
                for c in range(channels):
                    for u in range(kh):
                        for v in range(kw):
                            vector.append(
                                padded[
                                    n,
                                    c,
                                    i * stride[0] + u * dilation[0],
                                    j * stride[1] + v * dilation[1],
                                ]
                            )
                patches.append(torch.stack(vector))
        result.append(patches)
    return result


def outer_mean(vectors: list[Tensor]) -> Tensor:
    """(1/N) Σ v vᵀ."""
    total = sum(torch.outer(v, v) for v in vectors)
    assert isinstance(total, Tensor)
    return total / len(vectors)


def with_one(v: Tensor) -> Tensor:
    """[v, 1]."""
    return torch.cat([v, v.new_ones(1)])


def kronecker_precondition(
    gradient: Tensor, a_factor: Tensor, g_factor: Tensor, damping: float
) -> Tensor:
    """Solve ((G+γI) ⊗ (A+γI)) vec(V) = vec(∇) with the explicit Kronecker matrix (row-major)."""
    a = a_factor + damping * torch.eye(a_factor.shape[0], dtype=a_factor.dtype)
    g = g_factor + damping * torch.eye(g_factor.shape[0], dtype=g_factor.dtype)
    matrix = torch.kron(g, a)
    solution = torch.linalg.solve(matrix, gradient.reshape(-1))
    return solution.reshape(gradient.shape)


def eigenbasis_precondition(
    gradient: Tensor, a_factor: Tensor, g_factor: Tensor, damping: float
) -> Tensor:
    """Solve (G ⊗ A + γI) vec(V) = vec(∇) with the explicit Kronecker matrix (row-major): the
    damping on the Kronecker product's eigenvalues (George et al. 2018; KAISA's eigen method).
    ``a_factor`` may be a vector (a diagonal A)."""
    a = torch.diag(a_factor) if a_factor.dim() == 1 else a_factor
    matrix = torch.kron(g_factor, a)
    matrix = matrix + damping * torch.eye(matrix.shape[0], dtype=matrix.dtype)
    return torch.linalg.solve(matrix, gradient.reshape(-1)).reshape(gradient.shape)
