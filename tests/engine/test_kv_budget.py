"""KV pool sizing: pages from --num-pages or a --kv-memory budget; device/dtype defaults."""

from __future__ import annotations

import pytest
import torch

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.kv_budget import (
    GIB,
    kv_page_bytes,
    plan_kv_budget,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)

pytestmark = pytest.mark.slow


def test_kv_budget_from_memory_or_pages(loaded_model):
    config = loaded_model.config
    page = kv_page_bytes(config, 16, torch.float32)
    assert page == 30 * 2 * 16 * 3 * 64 * 4
    budget = plan_kv_budget(
        config, page_size=16, dtype=torch.float32, device=torch.device("cpu"), kv_memory_gb=0.5
    )
    assert budget.num_pages == (GIB // 2) // page and budget.total_bytes <= GIB // 2
    bf16 = plan_kv_budget(
        config, page_size=16, dtype=torch.bfloat16, device=torch.device("cpu"), kv_memory_gb=0.5
    )
    assert bf16.num_pages == 2 * budget.num_pages
    pinned = plan_kv_budget(
        config,
        page_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        num_pages=7,
        kv_memory_gb=0.5,
    )
    assert pinned.num_pages == 7  # --num-pages wins over --kv-memory
    with pytest.raises(ValueError, match="holds no page"):
        plan_kv_budget(
            config, page_size=16, dtype=torch.float32, device=torch.device("cpu"), kv_memory_gb=1e-6
        )


def test_device_and_dtype_defaults():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        resolve_dtype("float8", torch.device("cpu"))
    if not torch.cuda.is_available():
        assert resolve_device(None).type == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_kv_dtype_defaults_to_the_model_dtype_and_rejects_unknown_names():
    assert resolve_kv_dtype(None, torch.float32) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_kv_dtype("fp16", torch.float32) == torch.float16
    assert resolve_kv_dtype(torch.float32, torch.bfloat16) == torch.float32
    with pytest.raises(ValueError, match="unknown kv dtype 'int8'"):
        resolve_kv_dtype("int8", torch.float32)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        resolve_kv_dtype(torch.float64, torch.float32)
    assert EngineConfig().kv_dtype is None
    assert EngineConfig(kv_dtype="bf16").kv_dtype == "bf16"
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, fp32, bf16, fp16"):
        EngineConfig(kv_dtype="bfloat16x")
