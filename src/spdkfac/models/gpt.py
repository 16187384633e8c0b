"""A small GPT-style decoder-only language model, written with ``nn.Linear`` layers.

Attention is ``qkv`` and ``proj`` linear layers around
``F.scaled_dot_product_attention(is_causal=True)`` (not ``nn.MultiheadAttention``), so
K-FAC sees every projection as an ``nn.Linear``. Submodules are defined in forward order.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "FeedForward", "gpt_parameter_count"]

_INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``qkv`` (d → 3d), attention, ``proj`` (d → d)."""

    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, d]`` → ``[B, T, d]``; position t attends to positions ≤ t only."""
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each [B, heads, T, head dim]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        out: Tensor = self.drop(self.proj(y.transpose(1, 2).reshape(batch, length, width)))
        return out


class FeedForward(nn.Module):
    """``fc`` (d → r·d), GELU, ``proj`` (r·d → d), dropout."""

    def __init__(self, d_model: int, mlp_ratio: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., d]`` → ``[..., d]``."""
        out: Tensor = self.drop(self.proj(self.act(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_head: int, mlp_ratio: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model, mlp_ratio, dropout)

    def forward(self, x: Tensor) -> Tensor:
        """``[B, T, d]`` → ``[B, T, d]``."""
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """GPT-2-style language model over a vocabulary of ``vocab_size`` tokens.

    Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks, a final
    LayerNorm and a bias-free ``head``. With ``tie_weights`` the head's weight *is* the
    token embedding's (one ``Parameter``). Initialization as GPT-2: every linear and
    embedding weight ~ N(0, 0.02²), biases zero, and the residual projections
    (``attn.proj``, ``mlp.proj``) ~ N(0, (0.02 / √(2·n_layer))²).

    Args:
        vocab_size: Number of tokens (256 for bytes).
        block_size: Longest sequence (context length) the position embedding covers.
        n_layer: Transformer blocks.
        n_head: Attention heads; must divide ``d_model``.
        d_model: Width of the residual stream.
        mlp_ratio: Hidden width of the feed-forward layers, in multiples of ``d_model``.
        dropout: Dropout after the embeddings, the attention weights and each residual
            branch (0 disables it).
        tie_weights: Share the token embedding and the output head's weight.

    Raises:
        ValueError: A size is not a positive int, ``dropout`` is outside [0, 1), or
            ``n_head`` does not divide ``d_model``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        d_model: int = 128,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        sizes = {"vocab_size": vocab_size, "block_size": block_size, "n_layer": n_layer,
                 "n_head": n_head, "d_model": d_model, "mlp_ratio": mlp_ratio}  # fmt: skip
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_head, mlp_ratio, dropout) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(n_layer)
        if tie_weights:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = _INIT_STD / math.sqrt(2 * n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``[B, T, vocab_size]`` for token ids ``idx`` ``[B, T]`` (T ≤ block_size).

        Raises:
            ValueError: ``idx`` is not 2-D or longer than ``block_size``.
        """
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape [B, T], got {list(idx.shape)}")
        length = idx.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.block_size}")
        # Through the module (not its weight), so forward hooks see the positions.
        positions = self.pos_emb(torch.arange(length, device=idx.device))
        x = self.drop(self.tok_emb(idx) + positions)
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def gpt_parameter_count(
    vocab_size: int = 256,
    block_size: int = 128,
    n_layer: int = 2,
    d_model: int = 128,
    mlp_ratio: int = 4,
    tie_weights: bool = True,
) -> int:
    """Distinct parameters of :class:`GPT` with these sizes (the head counts once if tied).

    Per block: two LayerNorms (4d), ``qkv`` (3d² + 3d), attention ``proj`` (d² + d), ``fc``
    (r·d² + r·d) and feed-forward ``proj`` (r·d² + d).
    """
    d, r = d_model, mlp_ratio
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (r * d * d + r * d) + (r * d * d + d)
    head = 0 if tie_weights else vocab_size * d
    return vocab_size * d + block_size * d + n_layer * block + 2 * d + head
