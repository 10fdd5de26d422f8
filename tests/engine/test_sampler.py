import pytest
import torch

from prefixgate.gateway.engine.api import InvalidRequestError, SamplingParams
from prefixgate.gateway.engine.sampler import SampleRow, make_generator, sample


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
