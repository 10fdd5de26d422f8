"""The greedy continuation the model tests compare (fresh vs prefix hit, alone vs batched)."""

from __future__ import annotations

import torch

from prefixgate.engine.runner import SeqChunk


def greedy_after(runner, prompt: list[int], table: list[int], first: torch.Tensor,
                 new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens: the argmax of ``first`` (the prompt's last logits), then
    one decode step per token over the sequence's pages ``table``."""
    tokens = [int(first.argmax())]
    for step in range(new_tokens - 1):
        chunk = SeqChunk([tokens[-1]], len(prompt) + step, table, True)
        tokens.append(int(runner.execute([chunk])[0].argmax()))
    return tokens
