"""The backend objects (kernels/backend.py): bound to a pool once, a step's metadata prepared
once, every layer's forward = the oracle's write then attention; registry-created."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prefixgate import kernels
from prefixgate.kernels.cpu import ops
from prefixgate.kernels.sliding_window import paged_attention_windowed
from prefixgate.kernels.torch_cpu import backend as torch_backend
from tests.kernels.oracle import naive_copy_pages, naive_paged_attention, naive_write_kv
from tests.kernels.paged_case import ALL_DEVICES, TOLERANCES, PagedBatch, make_paged_batch

CTX, NEW = [30, 45, 5], [1, 9, 5]  # decode, a chunk after a cached prefix, a fresh prefill


def _backends() -> list[str]:
    names = ["torch"]
    try:
        import triton  # noqa: F401
    except ImportError:
        return names
    return [*names, "triton"]  # interpreted on CPU (tests/conftest.py sets TRITON_INTERPRET)


def _step_inputs(batch: PagedBatch, slots: torch.Tensor) -> kernels.AttentionInputs:
    starts = batch.query_start_loc.tolist()
    return kernels.AttentionInputs(
        batch.block_tables.tolist(), batch.seq_lens.tolist(), starts,
        max(b - a for a, b in zip(starts, starts[1:], strict=False)), slots,
        batch.block_tables, batch.seq_lens, batch.query_start_loc,
    )


def _new_slots(batch: PagedBatch) -> torch.Tensor:
    """The slots of each sequence's new rows (its last n_s positions)."""
    page_size, slots = batch.k_cache.shape[1], []
    starts, tables = batch.query_start_loc.tolist(), batch.block_tables.tolist()
    for s, ctx in enumerate(batch.seq_lens.tolist()):
        for pos in range(ctx - (starts[s + 1] - starts[s]), ctx):
            slots.append(tables[s][pos // page_size] * page_size + pos % page_size)
    return torch.tensor(slots, device=batch.query.device)


@pytest.mark.parametrize("name", _backends())
@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("native", [False, True])
def test_two_layer_step_matches_the_oracle(name: str, device: str, native: bool) -> None:
    if name == "triton" and native:
        pytest.skip("native is a torch-backend option")
    first = make_paged_batch(CTX, NEW, group_size=2, device=device, seed=1)
    # a second layer: other K/V and queries over the same pages (one step's addressing)
    layers = [first, replace(first, query=-first.query, k_cache=first.k_cache.flip(-1),
                             v_cache=-first.v_cache)]
    pool = torch.stack([torch.stack([b.k_cache, b.v_cache]) for b in layers])  # [2, 2, P, ...]
    backend = kernels.create_backend(name, pool, native=native)
    assert backend.name == name
    slots = _new_slots(layers[0])
    step = backend.prepare_metadata(_step_inputs(layers[0], slots))
    for index, batch in enumerate(layers):
        gen = torch.Generator().manual_seed(index)
        key, value = (torch.randn(slots.shape[0], *pool.shape[4:], generator=gen).to(device)
                      for _ in range(2))
        expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
        naive_write_kv(key, value, expected_k, expected_v, slots)
        out = step.forward(batch.query, key, value, pool[index, 0], pool[index, 1], batch.scale)
        assert torch.equal(pool[index, 0], expected_k) and torch.equal(pool[index, 1], expected_v)
        want = naive_paged_attention(replace(batch, k_cache=pool[index, 0], v_cache=pool[index, 1]))
        torch.testing.assert_close(out.cpu().double(), want, **TOLERANCES[torch.float32])
    used = {p for table, ctx in zip(first.block_tables.tolist(), CTX, strict=True)
            for p in table[: -(-ctx // pool.shape[3])]}
    spare = [p for p in range(pool.shape[2]) if p not in used][:2]
    src, dst = first.block_tables[0, :2].long(), torch.tensor(spare, device=device)
    expected = pool.clone()
    naive_copy_pages(expected, src, dst)
    backend.copy_pages(src, dst)
    assert torch.equal(pool, expected)


def test_the_native_writer_is_bound_once_and_checked_once_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if ops.library() is None:
        pytest.skip("the native library does not build here")
    checks: list[int] = []
    real = torch_backend.kv_write_accepts
    monkeypatch.setattr(torch_backend, "kv_write_accepts",
                        lambda *a: checks.append(1) or real(*a))
    batch = make_paged_batch(CTX, NEW, group_size=2, seed=1)
    pool = torch.stack([torch.stack([batch.k_cache, batch.v_cache])] * 3)  # 3 layers
    backend = kernels.create_backend("torch", pool, native=True)
    assert backend.kv_writer is not None
    slots = _new_slots(batch)
    for _ in range(2):  # two steps of three layers
        step = backend.prepare_metadata(_step_inputs(batch, slots))
        for layer in range(3):
            key = torch.randn(slots.shape[0], *pool.shape[4:])
            step.forward(batch.query, key, key, pool[layer, 0], pool[layer, 1], batch.scale)
    assert len(checks) == 2


def test_registry_lists_and_creates_the_backends() -> None:
    assert kernels.backend_spec("torch").native_cpu
    assert not kernels.backend_spec("triton").native_cpu
    with pytest.raises(ValueError, match="use one of \\('auto', 'triton', 'torch'\\)"):
        kernels.resolve_backend("cpu", "cuda-graphs")


@pytest.mark.parametrize("name", _backends())
def test_a_sliding_layer_passes_its_window_to_the_same_forward(name: str) -> None:
    # a full layer and a window-4 layer over one step's addressing, through one bound step
    batch = make_paged_batch(CTX, NEW, group_size=2, seed=2)
    pool = torch.stack([torch.stack([batch.k_cache, batch.v_cache])] * 2)
    step = kernels.create_backend(name, pool).prepare_metadata(
        _step_inputs(batch, slots := _new_slots(batch)))
    key = torch.randn(slots.shape[0], *pool.shape[4:])
    full = step.forward(batch.query, key, key, pool[0, 0], pool[0, 1], batch.scale)
    windowed = step.forward(batch.query, key, key, pool[1, 0], pool[1, 1], batch.scale, window=4)
    args = (batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
    want = paged_attention_windowed(batch.query, pool[1, 0], pool[1, 1], *args, 4)
    torch.testing.assert_close(windowed, want, **TOLERANCES[torch.float32])
    # a window as long as every context sees what a full layer sees
    unbounded = step.forward(batch.query, key, key, pool[1, 0], pool[1, 1], batch.scale,
                             window=max(CTX))
    torch.testing.assert_close(unbounded, full, **TOLERANCES[torch.float32])
