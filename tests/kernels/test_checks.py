"""Bad inputs fail with an error that names the argument."""

from __future__ import annotations

import pytest
import torch

from prefixgate.kernels.checks import check_attention_inputs, check_copy_inputs, check_write_inputs
from tests.kernels.paged_case import make_paged_batch


def _attention_args(**overrides):
    batch = make_paged_batch([20, 9], [1, 4], group_size=2)
    args = {
        "query": batch.query,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens,
        "query_start_loc": batch.query_start_loc,
    }
    args.update(overrides)
    return args


def test_valid_inputs_report_sizes() -> None:
    shapes = check_attention_inputs(**_attention_args())
    assert (shapes.num_tokens, shapes.num_q_heads, shapes.num_kv_heads) == (5, 4, 2)
    assert (shapes.page_size, shapes.num_seqs, shapes.group_size) == (16, 2, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"query": torch.randn(5, 3, 32)}, "num_q_heads 3 must be a multiple of num_kv_heads 2"),
        ({"query": torch.randn(5, 4, 16)}, "query head_dim 16 != cache head_dim 32"),
        ({"query": torch.randn(5, 128)}, "query must be 3-D"),
        ({"v_cache": torch.zeros(6, 16, 2, 32, dtype=torch.float16)}, "v_cache dtype"),
        ({"v_cache": torch.zeros(6, 8, 2, 32)}, "v_cache shape"),
        ({"seq_lens": torch.tensor([20, 9])}, "seq_lens must be torch.int32"),
        (
            {"query_start_loc": torch.tensor([0, 1], dtype=torch.int32)},
            "query_start_loc must have num_seqs \\+ 1 = 3 entries",
        ),
        (
            {"block_tables": torch.zeros(3, 4, dtype=torch.int32)},
            "block_tables has 3 rows but seq_lens has 2",
        ),
    ],
)
def test_attention_inputs_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_attention_inputs(**_attention_args(**overrides))


def test_write_inputs_rejected() -> None:
    cache = torch.zeros(4, 16, 2, 8)
    key = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries but key has 3 tokens"):
        check_write_inputs(key, key, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="does not match cache"):
        check_write_inputs(
            torch.randn(3, 4, 8),
            torch.randn(3, 4, 8),
            cache,
            cache.clone(),
            torch.tensor([0, 1, 2]),
        )


def test_copy_inputs_rejected() -> None:
    pool = torch.zeros(2, 2, 4, 16, 1, 8)
    with pytest.raises(ValueError, match="src must be torch.int64"):
        check_copy_inputs(pool, torch.tensor([0], dtype=torch.int32), torch.tensor([1]))
    with pytest.raises(ValueError, match="kv_pool must be 6-D"):
        check_copy_inputs(pool[0], torch.tensor([0]), torch.tensor([1]))
