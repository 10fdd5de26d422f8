"""prefixgate's runner vs transformers on the same GGUF (fp32), and paged-cache invariances.

Bounds (fp32 on CPU): last-token prefill logits within PREFILL_ATOL = 2.5e-4 of transformers'
(logits reach |30|; measured max-abs-diff 4.6e-5 .. 7.1e-5 on prompts of 37 to 1613 tokens).
Both sides dequantise the same Q4_1 blocks; the gap is summation order (fused q|k|v and
gate|up oneDNN GEMMs, paged attention). Logits of the same tokens computed through different
page layouts / chunkings / batch mixes agree within LAYOUT_ATOL (different GEMM row counts
round differently; measured ~1.3e-4), and greedy continuations are identical token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from prefixgate import kernels
from prefixgate.engine.runner import ModelRunner, SeqChunk

pytestmark = pytest.mark.slow

PREFILL_ATOL = 2.5e-4
LAYOUT_ATOL = 5e-4
NEW_TOKENS = 32

SYSTEM = (
    "You are a meticulous assistant working in a swarm of coding agents. Always answer with "
    "short, correct statements and cite the file you looked at."
)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Write a haiku about caches."},
    ],
    [{"role": "user", "content": "List three prime numbers greater than 100."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this Python function\n"}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Was ist ein Seitenfehler? Antworte kurz."},
        {"role": "assistant", "content": "Ein Zugriff auf eine nicht geladene Seite."},
        {"role": "user", "content": "And in English, with an example?"},
    ],
    [{"role": "user", "content": "Translate to French: the weather is lovely today 🌞"}],
]


class Pages:
    """Hands out distinct page ids of the shared runner's pool (optionally shuffled)."""

    def __init__(self, runner: ModelRunner, seed: int | None = None) -> None:
        self.free = list(range(runner.num_pages))
        if seed is not None:
            random.Random(seed).shuffle(self.free)
        self.page_size = runner.page_size

    def take(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.page_size)
        taken, self.free = self.free[:count], self.free[count:]
        return taken


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [T, V]


def _greedy(
    runner: ModelRunner, prompts: list[list[int]], pages: Pages, max_new: int
) -> list[list[int]]:
    """Batched greedy decoding of ``prompts`` (stops a sequence at an EOS id)."""
    eos = set(runner.eos_token_ids)
    tables = [pages.take(len(p) + max_new) for p in prompts]
    logits = runner.execute([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)])
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while True:
        for seq, token in zip(active, logits.argmax(-1).tolist(), strict=True):
            outputs[seq].append(token)
        active = [s for s in active if outputs[s][-1] not in eos and len(outputs[s]) < max_new]
        if not active:
            return outputs
        logits = runner.execute(
            [
                SeqChunk([outputs[s][-1]], len(prompts[s]) + len(outputs[s]) - 1, tables[s], True)
                for s in active
            ]
        )


def _truncate_at_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template(chat) for chat in CHATS]


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    text = "\n".join(
        f"def handler_{i}(request):\n    # route {i}: validate, then answer\n"
        f"    return {{'status': {200 + i % 3}, 'body': request.get('q{i}', 'ünïcødé {i}')}}\n"
        for i in range(30)
    )
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Review this:\n" + text}])
    assert len(ids) > 1500
    return ids


@pytest.fixture(scope="module")
def long_prompt_reference(hf_model, long_prompt) -> torch.Tensor:
    return _hf_logits(hf_model, long_prompt)  # [T, V], every position


def test_prefill_logits_match_transformers(
    model_runner, hf_model, chat_prompts, long_prompt, long_prompt_reference
):
    pages = Pages(model_runner)
    for ids in [*chat_prompts[:3], long_prompt]:
        ours = model_runner.execute([SeqChunk(ids, 0, pages.take(len(ids)), True)])[0]
        ref = long_prompt_reference[-1] if ids is long_prompt else _hf_logits(hf_model, ids)[-1]
        diff = (ours - ref).abs().max().item()
        assert diff < PREFILL_ATOL, f"prefill logits differ by {diff} for a {len(ids)}-token prompt"
        assert int(ours.argmax()) == int(ref.argmax())


def test_chunked_prefill_matches_transformers_at_every_chunk_end(
    model_runner, long_prompt, long_prompt_reference
):
    # each chunk reads the previous chunks' K/V from the pages (start_pos > 0)
    pages = Pages(model_runner)
    table = pages.take(len(long_prompt))
    ref = long_prompt_reference
    bounds = [0, 37, 200, 201, 480, len(long_prompt)]  # page-aligned and not, a 1-token chunk
    for start, end in zip(bounds, bounds[1:], strict=False):
        ours = model_runner.execute([SeqChunk(long_prompt[start:end], start, table, True)])[0]
        diff = (ours - ref[end - 1]).abs().max().item()
        assert diff < PREFILL_ATOL, f"chunk {start}:{end} logits differ by {diff}"


def test_greedy_continuations_identical_to_transformers(model_runner, hf_model, chat_prompts):
    # ours: all prompts decoded together in one batch (mixed lengths, scattered pages)
    eos = model_runner.eos_token_ids
    ours = _greedy(model_runner, chat_prompts, Pages(model_runner, seed=1), NEW_TOKENS)
    assert sum(len(o) for o in ours) >= 5 * 16  # the comparison covers real continuations
    # transformers' greedy choice at every step, teacher-forced with our tokens: one forward per
    # prompt instead of 32 cached steps (the same decisions as its generate(), much cheaper)
    for ids, mine in zip(chat_prompts, ours, strict=True):
        logits = _hf_logits(hf_model, ids + mine[:-1])[len(ids) - 1 :]  # [len(mine), V]
        assert logits.argmax(-1).tolist() == mine
    # and transformers' own generate() loop on one prompt, end to end
    with torch.inference_mode():
        generated = hf_model.generate(
            torch.tensor([chat_prompts[1]]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    assert _truncate_at_eos(generated[0, len(chat_prompts[1]) :].tolist(), eos) == ours[1]


def test_prefix_from_cached_pages_equals_fresh(model_runner, chat_prompts):
    prompt = chat_prompts[4]
    page_size = model_runner.page_size
    cached = (len(prompt) // page_size - 1) * page_size  # a block-aligned hit, as the cache gives
    assert cached >= 2 * page_size
    pages = Pages(model_runner)
    fresh_table = pages.take(len(prompt) + NEW_TOKENS)
    fresh = model_runner.execute([SeqChunk(prompt, 0, fresh_table, True)])[0]

    # an earlier request computed the prefix into its pages ...
    prefix_table = pages.take(cached)
    assert model_runner.execute([SeqChunk(prompt[:cached], 0, prefix_table, False)]).shape[0] == 0
    # ... a new sequence reuses them and only computes its suffix
    table = prefix_table + pages.take(len(prompt) + NEW_TOKENS - cached)
    hit = model_runner.execute([SeqChunk(prompt[cached:], cached, table, True)])[0]
    assert (hit - fresh).abs().max().item() < LAYOUT_ATOL

    # and both continue identically
    def continue_greedy(first: torch.Tensor, table: list[int]) -> list[int]:
        tokens = [int(first.argmax())]
        for step in range(12):
            logits = model_runner.execute([SeqChunk([tokens[-1]], len(prompt) + step, table, True)])
            tokens.append(int(logits[0].argmax()))
        return tokens

    assert continue_greedy(hit, table) == continue_greedy(fresh, fresh_table)


def test_scattered_pages_equal_contiguous(model_runner, chat_prompts):
    prompt = chat_prompts[1]
    contiguous = list(range(-(-len(prompt) // model_runner.page_size)))
    scattered = Pages(model_runner, seed=7).take(len(prompt))
    assert scattered != sorted(scattered)
    a = model_runner.execute([SeqChunk(prompt, 0, contiguous, True)])[0]
    b = model_runner.execute([SeqChunk(prompt, 0, scattered, True)])[0]
    assert (a - b).abs().max().item() < 1e-5
    decode_a = model_runner.execute([SeqChunk([int(a.argmax())], len(prompt), contiguous, True)])
    decode_b = model_runner.execute([SeqChunk([int(b.argmax())], len(prompt), scattered, True)])
    assert (decode_a - decode_b).abs().max().item() < 1e-5


def test_copy_on_write_fork(model_runner, tokenizer, chat_prompts):
    page_size = model_runner.page_size
    prompt = chat_prompts[0]
    if len(prompt) % page_size == 0:
        prompt = prompt[:-1]
    pages = Pages(model_runner, seed=3)
    parent = pages.take(len(prompt) + 1)
    model_runner.execute([SeqChunk(prompt, 0, parent, False)])
    # the child shares the full pages and gets a private copy of the partial last page
    child_last = pages.take(1)[0]
    child = parent[:-1] + [child_last]
    parent_token, child_token = tokenizer.encode(" Paris")[0], tokenizer.encode(" Hmm")[0]
    forked = model_runner.execute(
        [
            SeqChunk([parent_token], len(prompt), parent, True),
            SeqChunk([child_token], len(prompt), child, True),
        ],
        copy_pairs=[(parent[-1], child_last)],  # runs before the forward writes either token
    )
    for row, token in ((0, parent_token), (1, child_token)):
        table = pages.take(len(prompt) + 1)
        fresh = model_runner.execute([SeqChunk([*prompt, token], 0, table, True)])[0]
        assert (forked[row] - fresh).abs().max().item() < LAYOUT_ATOL
    # the parent's page did not see the child's write: continue the parent, compare to fresh
    nxt = int(forked[0].argmax())
    cont = model_runner.execute([SeqChunk([nxt], len(prompt) + 1, parent, True)])[0]
    table = pages.take(len(prompt) + 2)
    fresh = model_runner.execute([SeqChunk([*prompt, parent_token, nxt], 0, table, True)])[0]
    assert (cont - fresh).abs().max().item() < LAYOUT_ATOL


def test_mixed_prefill_and_decode_batch_equals_separate(model_runner, chat_prompts):
    pages = Pages(model_runner, seed=11)
    decoders = chat_prompts[2:4]
    tables = [pages.take(len(p) + 1) for p in decoders]
    firsts = []
    for prompt, table in zip(decoders, tables, strict=True):
        firsts.append(int(model_runner.execute([SeqChunk(prompt, 0, table, True)])[0].argmax()))
    prefill_prompt = chat_prompts[5]
    prefill_table = pages.take(len(prefill_prompt))
    decode_chunks = [
        SeqChunk([tok], len(p), t, True) for tok, p, t in zip(firsts, decoders, tables, strict=True)
    ]
    # prefill in the middle, one chunk not sampling: rows come back in chunk order
    mixed = model_runner.execute(
        [decode_chunks[0], SeqChunk(prefill_prompt, 0, prefill_table, True), decode_chunks[1]]
    )
    assert mixed.shape == (3, model_runner.vocab_size)
    separate = [
        model_runner.execute([decode_chunks[0]])[0],
        model_runner.execute([SeqChunk(prefill_prompt, 0, prefill_table, True)])[0],
        model_runner.execute([decode_chunks[1]])[0],
    ]
    for row, logits in enumerate(separate):
        assert (mixed[row] - logits).abs().max().item() < LAYOUT_ATOL
    partial = model_runner.execute(
        [decode_chunks[0], SeqChunk(prefill_prompt, 0, prefill_table, False), decode_chunks[1]]
    )
    assert partial.shape == (2, model_runner.vocab_size)
    assert (partial[1] - separate[2]).abs().max().item() < LAYOUT_ATOL


def test_decode_over_shared_prefix_pages_matches_transformers(
    model_runner, hf_model, tokenizer, long_prompt
):
    """Agents on one cached system prompt: their decode rows read the shared pages together
    (cascade attention, kernels/attention_plan.py); outputs match transformers and the
    per-sequence path."""
    page_size = model_runner.page_size
    shared = (len(long_prompt) // page_size) * page_size  # the whole-block prefix hit
    tails = [tokenizer.encode(t) for t in (" First agent:", " Second agent, more words:", " 3:")]
    prompts = [long_prompt[:shared] + tail for tail in tails]
    steps = 6

    def run(shared_prefix_attention: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        model_runner.shared_prefix_attention = shared_prefix_attention
        pages = Pages(model_runner, seed=5)
        prefix_table = pages.take(shared)
        model_runner.execute([SeqChunk(long_prompt[:shared], 0, prefix_table, False)])
        tables = [prefix_table + pages.take(len(t) + steps) for t in tails]
        # each agent computes only its own tail after the cached prefix
        logits = model_runner.execute(
            [SeqChunk(t, shared, table, True) for t, table in zip(tails, tables, strict=True)]
        )
        tokens = [[tok] for tok in logits.argmax(-1).tolist()]
        rows = []
        for step in range(steps):
            chunks = [
                SeqChunk([out[-1]], len(p) + step, table, True)
                for out, p, table in zip(tokens, prompts, tables, strict=True)
            ]
            plan = kernels.plan_attention(
                [c.block_table for c in chunks],
                [c.start_pos + 1 for c in chunks],
                list(range(len(chunks) + 1)),
                page_size=page_size,
                kv_row_elems=1,
                share_prefixes=shared_prefix_attention,
            )
            # the case exercises what it claims: one shared run over the whole prefix
            assert [g.shared_len for g in plan.shared] == (
                [shared] if shared_prefix_attention else []
            )
            logits = model_runner.execute(chunks)
            rows.append(logits)
            for out, tok in zip(tokens, logits.argmax(-1).tolist(), strict=True):
                out.append(tok)
        return tokens, rows

    try:
        together, together_logits = run(True)
        alone, alone_logits = run(False)
    finally:
        model_runner.shared_prefix_attention = True
    assert together == alone
    for a, b in zip(together_logits, alone_logits, strict=True):
        assert (a - b).abs().max().item() < LAYOUT_ATOL
    for prompt, mine in zip(prompts, together, strict=True):
        reference = _hf_logits(hf_model, prompt + mine[:-1])[len(prompt) - 1 :]
        assert reference.argmax(-1).tolist() == mine
