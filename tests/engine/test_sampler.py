import pytest
import torch

from prefixgate.engine.api import InvalidRequestError, SamplingParams
from prefixgate.engine.sampler import SampleRow, make_generator, sample, verify


def row(seed=None, choice=0, prompt=(), output=(), **kw):
    return SampleRow(SamplingParams(**kw), list(prompt) + list(output), len(prompt),
                     make_generator(seed, choice))


def logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_is_argmax():
    assert sample(logits([0, 3, 1], [5, 0, 0]), [row(temperature=0), row(temperature=0)]).token_ids == [1, 0]


def test_top_k_1_and_tiny_top_p_behave_like_greedy():
    lg = torch.randn(4, 50)
    expected = lg.argmax(-1).tolist()
    assert sample(lg.clone(), [row(top_k=1) for _ in range(4)]).token_ids == expected
    assert sample(lg.clone(), [row(top_p=1e-6) for _ in range(4)]).token_ids == expected


def test_min_p_excludes_unlikely_tokens():
    lg = logits([10.0, 9.5, 0.0, -5.0])
    picks = {sample(lg.clone(), [row(min_p=0.3)]).token_ids[0] for _ in range(200)}
    assert picks <= {0, 1} and picks == {0, 1}


def test_seed_reproduces_whatever_the_batch():
    lg = torch.randn(1, 1000)
    first = [sample(lg.clone(), [row(seed=7)]).token_ids[0] for _ in range(1)]
    g = row(seed=7)
    batch = sample(torch.cat([torch.randn(2, 1000), lg]), [row(), row(), row(seed=7)]).token_ids[2]
    assert batch == first[0] == sample(lg.clone(), [g]).token_ids[0]
    # a different choice index of the same request draws different noise
    draws = {sample(lg.clone(), [row(seed=7, choice=c)]).token_ids[0] for c in range(8)}
    assert len(draws) > 1


def test_sampling_follows_the_distribution():
    lg = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.bincount(torch.tensor([sample(lg.clone(), [row()]).token_ids[0] for _ in range(3000)]),
                            minlength=3).float() / 3000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_penalties_push_repeated_tokens_down():
    lg = logits([2.0, 1.9, 0.0])
    assert sample(lg.clone(), [row(temperature=0, output=[0], presence_penalty=0.5)]).token_ids == [1]
    assert sample(lg.clone(), [row(temperature=0, output=[0, 0, 0], frequency_penalty=0.05)]).token_ids == [1]
    assert sample(lg.clone(), [row(temperature=0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]
    assert sample(lg.clone(), [row(temperature=0, output=[0])]).token_ids == [0]


def test_logprobs_are_raw_log_softmax():
    lg = logits([1.0, 2.0, 3.0])
    res = sample(lg.clone(), [row(temperature=0, logprobs=True, top_logprobs=2)])
    ref = torch.log_softmax(lg, -1)[0]
    assert res.token_ids == [2]
    assert res.logprobs[0] == pytest.approx(ref[2].item())
    assert res.top_ids[0] == [2, 1] and res.top_logprobs[0] == pytest.approx(ref[[2, 1]].tolist())


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-1),
                                 dict(min_p=2), dict(n=0), dict(top_logprobs=21), dict(repetition_penalty=0)])
def test_bad_params_are_named(bad):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        SamplingParams(**bad)


# ------------------------------------------------------------------ verify (speculative decoding)

def _reference_target(lg: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution a row samples from, written out independently of the sampler."""
    probs = torch.softmax(lg / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (rank and mass >= top_p):
            break
        keep[token] = True
        mass += probs[token].item()
    probs = probs * keep
    return probs / probs.sum()


def _tv(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Total-variation distance between observed counts and a distribution."""
    return 0.5 * (counts / counts.sum() - expected).abs().sum().item()


# vocabulary 6; each position's logits differ, so a verifier mixing up positions fails too
VERIFY_LOGITS = torch.tensor([[1.2, 0.9, 0.4, 0.0, -0.5, -1.0],
                              [0.1, 1.0, 0.6, 0.8, -0.2, -0.6],
                              [-0.3, 0.2, 1.1, 0.7, 0.0, 0.5]])
TRIALS = 20_000
TV_BOUND = 0.025  # the sampling noise of 20k trials over 6 tokens is ~0.008


@pytest.mark.parametrize(("params", "drafts"), [
    (dict(temperature=0.8), (1, 3)),
    (dict(temperature=1.3, top_k=3), (1, 4)),  # the second draft is outside the top 3: never kept
    (dict(temperature=1.0, top_p=0.7), (0, 2)),
])
@pytest.mark.parametrize("seeded", [False, True])
def test_verify_emits_the_target_distribution(params, drafts, seeded):
    """Rejection sampling of two drafts: the first emitted token ~ p_1, the second (after an
    accepted first draft) ~ p_2, the bonus token (after both) ~ p_3, the number accepted as
    p_1(x_1), p_1(x_1) * p_2(x_2); and the broken verifiers would fail the same bound."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(123) if seeded else None
    target = [_reference_target(VERIFY_LOGITS[i], **params) for i in range(3)]
    rows = [SampleRow(SamplingParams(**params), [], 0, generator) for _ in range(3 * TRIALS)]
    results = verify(VERIFY_LOGITS.repeat(TRIALS, 1), rows, [drafts] * TRIALS)

    first = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=6).float()
    assert _tv(first, target[0]) < TV_BOUND
    p_keep = [target[0][drafts[0]].item(), target[1][drafts[1]].item()]
    accepted = torch.bincount(torch.tensor([r.num_accepted for r in results]), minlength=3).float()
    want = torch.tensor([1 - p_keep[0], p_keep[0] * (1 - p_keep[1]), p_keep[0] * p_keep[1]])
    assert _tv(accepted, want) < TV_BOUND
    second = [r.token_ids[1] for r in results if r.num_accepted >= 1]
    assert _tv(torch.bincount(torch.tensor(second), minlength=6).float(), target[1]) < 2 * TV_BOUND
    bonus = [r.token_ids[2] for r in results if r.num_accepted == 2]
    if len(bonus) > 1000:
        assert _tv(torch.bincount(torch.tensor(bonus), minlength=6).float(), target[2]) < 3 * TV_BOUND
    assert all(len(r.token_ids) == r.num_accepted + 1 for r in results)
    assert all(list(r.token_ids[: r.num_accepted]) == list(drafts[: r.num_accepted]) for r in results)

    # The bound is tight enough to fail broken verifiers, simulated here on the same trials.
    draw = torch.Generator().manual_seed(5)
    plain = torch.multinomial(target[0], TRIALS, replacement=True, generator=draw)
    keep = torch.rand(TRIALS, generator=draw) < p_keep[0]
    # accept-always: the first token is always the draft
    assert _tv(torch.bincount(torch.full((TRIALS,), drafts[0]), minlength=6).float(), target[0]) > 4 * TV_BOUND
    # on a rejection, resample from p instead of the residual (p without the draft)
    from_p = torch.where(keep, torch.tensor(drafts[0]), plain)
    assert _tv(torch.bincount(from_p, minlength=6).float(), target[0]) > 4 * TV_BOUND
    # ignoring top-k / top-p: the raw temperature distribution
    raw = torch.softmax(VERIFY_LOGITS[0] / params["temperature"], -1)
    if "top_k" in params or "top_p" in params:
        assert 0.5 * (raw - target[0]).abs().sum().item() > 4 * TV_BOUND


def test_verify_greedy_accepts_the_argmax_prefix():
    lg = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    rows = [SampleRow(SamplingParams(temperature=0), [], 0, None) for _ in range(6)]
    full, short = verify(torch.cat([lg, lg]), rows, [(1, 0), (1, 2)])
    assert (full.token_ids, full.num_accepted) == ([1, 0, 2], 2)  # both kept, then the bonus
    assert (short.token_ids, short.num_accepted) == ([1, 0], 1)  # 2 rejected: replaced by the argmax


def test_verify_masks_each_position_and_flags_a_dead_end():
    """Row i of a constrained sequence is masked by the grammar after drafts 0..i-1: greedy
    picks the best allowed token, and a row that allows nothing is a dead end (not token 0)."""
    lg = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 3.0]])
    rows = [SampleRow(SamplingParams(temperature=0), [], 0, None) for _ in range(6)]
    allow = lambda *ids: sum(1 << i for i in ids)  # noqa: E731 - one 32-bit word of a bitmask
    masks = torch.tensor([[allow(1)], [allow(2)], [allow(0, 1)],   # the 2nd row forbids 0
                          [allow(1)], [allow(0)], [0]], dtype=torch.int32)  # the last allows nothing
    masked, dead = verify(torch.cat([lg, lg]), rows, [(1, 0), (1, 0)], masks)
    assert (masked.token_ids, masked.num_accepted, masked.dead_end) == ([1, 2], 1, False)
    assert (dead.token_ids[:2], dead.num_accepted, dead.dead_end) == ([1, 0], 2, True)


def test_verify_with_a_seed_emits_what_plain_sampling_would():
    """Each emitted token takes the draw a plain decode of its position would: a seeded request
    gives the same tokens whether it drafted or not, and leaves its generator in the same state."""
    lg = torch.randn(4, 200)
    params = dict(temperature=0.9, top_p=0.95)
    plain_gen = make_generator(11, 0)
    plain = [sample(lg[i : i + 1].clone(), [SampleRow(SamplingParams(**params), [], 0, plain_gen)]).token_ids[0]
             for i in range(3)]
    wrong = (plain[2] + 1) % 200
    spec_gen = make_generator(11, 0)
    rows = [SampleRow(SamplingParams(**params), [], 0, spec_gen) for _ in range(4)]
    result = verify(lg.clone(), rows, [(plain[0], plain[1], wrong)])
    assert (result[0].token_ids, result[0].num_accepted) == (plain, 2)
    assert torch.equal(spec_gen.get_state(), plain_gen.get_state())


def test_verify_penalties_see_the_drafts_before_each_position():
    lg = torch.tensor([[0.0, 2.0, 1.9], [0.0, 2.0, 1.9]])
    params = SamplingParams(temperature=0, presence_penalty=0.5)
    # position 1 follows draft 1: penalised, so 2 wins there; without it 1 would
    rows = [SampleRow(params, [], 0, None), SampleRow(params, [1], 0, None)]
    assert verify(lg, rows, [(1,)])[0].token_ids == [1, 2]


def test_verify_logprobs_are_those_of_each_emitted_position():
    lg = torch.randn(3, 20)
    lg[0, 4] = 50.0  # draft 4 is certain to be kept at temperature 1
    params = SamplingParams(temperature=1.0, logprobs=True, top_logprobs=2)
    rows = [SampleRow(params, [], 0, None) for _ in range(3)]
    result = verify(lg.clone(), rows, [(4, 7)])[0]
    ref = torch.log_softmax(lg, -1)
    for i, token in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-5)
        assert result.top_ids[i] == ref[i].topk(2).indices.tolist()
