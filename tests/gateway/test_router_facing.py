"""What external routers read from a replica (#40.1), on the live gateway: the vLLM-named
series next to ours in /metrics, ``parent`` in /v1/models, and the render endpoints' token
ids, which equal what the completion endpoints actually run."""

from __future__ import annotations

import pytest

from tests.gateway.test_metrics import scrape, value
from tests.live_gateway import NUM_PAGES, PAGE_SIZE

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three rivers."}]


def test_vllm_names_next_to_ours(client, gateway):
    families = scrape(client)
    model = gateway.model
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        ours = value(families, f"prefixgate:{name}", f"prefixgate:{name}", model_name=model)
        theirs = value(families, f"vllm:{name}", f"vllm:{name}", model_name=model)
        assert theirs == ours  # one snapshot per scrape; usage is a fraction in both
    assert value(families, "vllm:cache_config_info", "vllm:cache_config_info",
                 block_size=str(PAGE_SIZE), num_gpu_blocks=str(NUM_PAGES)) == 1


def test_models_carry_parent(client, gateway):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == gateway.model and "parent" in card and card["parent"] is None
    assert card["root"]


def test_render_gives_the_ids_the_completion_runs(client, gateway):
    chat = {"model": gateway.model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    rendered = client.post("/v1/chat/completions/render", json=chat)
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    assert body["model"] == gateway.model and body["sampling_params"]["max_tokens"] == 1
    tokenized = client.post("/tokenize", json={"model": gateway.model, "messages": MESSAGES,
                                               "add_generation_prompt": True}).json()["tokens"]
    assert body["token_ids"] == tokenized
    ran = client.post("/v1/chat/completions", json=chat).json()
    assert ran["usage"]["prompt_tokens"] == len(body["token_ids"])
    completions = {"model": gateway.model, "prompt": ["one two", "three four five"],
                   "max_tokens": 2}
    listed = client.post("/v1/completions/render", json=completions)
    assert listed.status_code == 200, listed.text
    for entry, prompt in zip(listed.json(), completions["prompt"], strict=True):
        assert entry["token_ids"] == client.post("/tokenize", json={
            "model": gateway.model, "prompt": prompt}).json()["tokens"]
    bad = client.post("/v1/chat/completions/render", json={**chat, "model": "nope"})
    assert bad.status_code == 404 and "error" in bad.json()
