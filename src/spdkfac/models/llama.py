"""A tiny LLaMA-style decoder (the layout torchtitan's tensor-parallel plan expects), written
with ``nn.Linear`` layers so that K-FAC sees every projection.

Token embedding; blocks of RMSNorm → causal attention (separate ``wq``, ``wk``, ``wv``,
``wo`` projections without bias, no rotary embedding) and RMSNorm → SwiGLU MLP (``w1``,
``w3``, ``w2``); a final RMSNorm and the ``output`` projection. The attention reads its
heads from the query projection's rows, so a column-wise split of ``wq``/``wk``/``wv``
across tensor-parallel ranks splits the heads
(:func:`spdkfac.comm.tensor_parallel_plan.parallelize_llama`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Attention", "Block", "FeedForward", "Llama"]


class Attention(nn.Module):
    """Causal self-attention over ``dim // heads``-wide heads (as many as ``wq``'s rows)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape  # the local heads under tensor parallelism
        return x.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, tokens, _ = y.shape
        out: Tensor = self.wo(y.transpose(1, 2).reshape(batch, tokens, -1))
        return out


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Llama(nn.Module):
    """Token ids ``[B, T]`` → next-token logits ``[B, T, vocab]``; ``block_size`` is the
    context length it is built for (nothing reads it but the simulator: no positional
    embedding)."""

    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, hidden: int, block_size: int = 128
    ) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.block_size = block_size
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        out: Tensor = self.output(self.norm(x))
        return out
