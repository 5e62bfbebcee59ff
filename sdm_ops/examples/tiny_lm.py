"""A small language model built on ``SparseDeltaMemory``, the example that ``sdm_ops.serve``
exports and packages: a prompt entry point that returns each layer's final bank, and a decode
step that continues from those banks in place."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sdm_ops.nn import SparseDeltaMemory

MEMORY = dict(heads=2, head_dim=32, factors=(16, 16), read_topk=4, write_topk=4, chunk_size=16)


class TinyLM(nn.Module):
    """Token embedding -> ``layers`` residual blocks ``x + memory(norm(x))`` -> norm -> logits.

    ``forward(tokens [B, T]) -> (logits [B, T, vocab], states)``, ``states`` a list of each
    layer's final bank ``[B, H, S, D]``; ``step_(tokens [B, T], states) -> logits`` continues
    from ``states`` and updates them in place. ``memory`` holds ``SparseDeltaMemory``'s
    options (default ``MEMORY``).
    """

    def __init__(self, vocab: int = 256, d_model: int = 64, layers: int = 2, **memory):
        super().__init__()
        memory = {**MEMORY, **memory}
        self.embed = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(nn.RMSNorm(d_model) for _ in range(layers))
        self.memories = nn.ModuleList(SparseDeltaMemory(d_model, **memory) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor]]:
        x, states = self.embed(tokens), []
        for norm, memory in zip(self.norms, self.memories):
            y, state = memory(norm(x), return_state=True)
            x = x + y
            states.append(state)
        return self.head(self.norm(x)), states

    @torch.no_grad()
    def step_(self, tokens: Tensor, states: list[Tensor]) -> Tensor:
        x = self.embed(tokens)
        for norm, memory, state in zip(self.norms, self.memories, states):
            x = x + memory.step_(norm(x), state)
        return self.head(self.norm(x))
