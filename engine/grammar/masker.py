"""Token bitmasks of a step's constrained rows, filled off the critical path.

The engine knows, before a step's forward pass, which constrained sequences will sample in it,
and their grammar states are final by then (each accepted its last token when it was sampled).
So :meth:`TokenMasker.start` fills their bitmask rows on a worker thread while the forward
runs, and :meth:`TokenMasker.result` waits for it only when the logits are ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr


class TokenMasker:
    """Fills ``[rows, ceil(vocab / 32)]`` int32 bitmasks for lists of matchers.

    Args:
        vocab_size: the logits width the masks cover.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        # one native thread: the forward pass already has the cores; one row takes microseconds
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixgate-grammar")

    def _fill(self, matchers: Sequence[xgr.GrammarMatcher]) -> torch.Tensor:
        bitmask = torch.empty((len(matchers), self.num_words), dtype=torch.int32)
        try:
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)
        except RuntimeError:
            # NOTE: one matcher that cannot produce a mask (terminated, or an internal error)
            # fails the whole batch call; fill row by row so that only its row is empty (a
            # dead end the engine fails alone) and every other row keeps its grammar
            for row, matcher in enumerate(matchers):
                try:
                    matcher.fill_next_token_bitmask(bitmask, row)
                except RuntimeError:
                    bitmask[row].zero_()
        return bitmask

    def start(self, matchers: Sequence[xgr.GrammarMatcher]) -> Future[torch.Tensor]:
        """Begin filling one row per matcher (row i for matchers[i])."""
        return self._pool.submit(self._fill, list(matchers))

    def fill_now(self, matchers: Sequence[xgr.GrammarMatcher]) -> torch.Tensor:
        return self._fill(matchers)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
