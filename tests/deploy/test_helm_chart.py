"""The Helm chart (deploy/helm/prefixgate), rendered offline by Helm's own engine
(``helm-python-sdk`` embeds Helm v4 as a library: the templates run exactly as ``helm
template`` runs them), linted strictly, and every object it renders checked against the
Kubernetes schemas (``kubernetes-validate``, strict: unknown fields are errors). The two custom
resources (ServiceMonitor, InferencePool) are not in those schemas: they are checked against
schemas written here from their API references (required fields, types, enums), not against
the upstream CRDs. No cluster: nothing here proves a pod starts (docs/fleet.md)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python.chart", reason="SKIPPED LOUDLY: helm-python-sdk is "
                           "not installed (`make setup` installs the dev extras)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="SKIPPED LOUDLY: "
                                          "kubernetes-validate is not installed (`make setup`)")

from prefixgate.gateway.scaleout.kv_events.config import parse_kv_events_config  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "prefixgate"

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
# monitoring.coreos.com/v1 ServiceMonitor: the fields this chart uses (prometheus-operator's API)
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"spec": {
        "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
        "properties": {
            "selector": {"type": "object", "properties": {"matchLabels": _LABELS},
                         "additionalProperties": False},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                               "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
        }}},
}
# inference.networking.k8s.io/v1 InferencePool (Gateway API Inference Extension v1)
INFERENCE_POOL = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {"spec": {
        "type": "object", "required": ["selector", "targetPorts", "endpointPickerRef"],
        "additionalProperties": False,
        "properties": {
            "selector": {"type": "object", "required": ["matchLabels"],
                         "properties": {"matchLabels": _LABELS}, "additionalProperties": False},
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "required": ["number"], "additionalProperties": False,
                "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
            "endpointPickerRef": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {
                    "group": {"type": "string"}, "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1, "maxLength": 253},
                    "port": {"type": "object", "required": ["number"],
                             "properties": {"number": {"type": "integer", "minimum": 1,
                                                       "maximum": 65535}}},
                    "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
        }}},
}
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
          ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL}


def render(values: dict) -> list[dict]:
    chart = helm.Chart.load(CHART)
    manifests = chart.render(values=values, name="pg", namespace="llm")
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def gpu_values() -> dict:
    return yaml.safe_load((CHART / "values-gpu.yaml").read_text())


VARIANTS = {"cpu": {}, "gpu": gpu_values(),
            "everything": {"serviceMonitor": {"enabled": True}, "servedModelName": "smol",
                           "inferencePool": {"enabled": True}, "replicas": {"count": 3}}}


def test_the_chart_lints_strictly():
    for values in VARIANTS.values():
        report = helm.lint(CHART, values, strict=True)
        assert not report["errors"], report
        assert all(m["severity"] < 2 for m in report["messages"]), report  # info only


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates(variant):
    objects = render(VARIANTS[variant])
    version = kubernetes_validate.latest_version()
    kinds = set()
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        kinds.add(key[1])
        if key in CUSTOM:
            jsonschema.validate(obj, CUSTOM[key])
        else:
            kubernetes_validate.validate(obj, version, strict=True)
    expected = {"Service", "StatefulSet", "Deployment"}
    if variant != "cpu":
        expected |= {"ServiceMonitor", "InferencePool", "ConfigMap"}
    assert expected <= kinds


def _by(objects: list[dict], kind: str, component: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind
              and o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    return obj


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_pieces_fit_together(variant):
    values = VARIANTS[variant]
    objects = render(values)
    replicas = _by(objects, "StatefulSet", "replica")
    pod = replicas["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = _env(container)
    # probes and resources on every workload
    for workload in (o for o in objects if o["kind"] in ("StatefulSet", "Deployment")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe") and c.get("resources"), c
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    # GPU values ask for one GPU and run on cuda; CPU values do not
    limits = container["resources"].get("limits", {})
    assert ("nvidia.com/gpu" in limits) == (variant == "gpu")
    assert (env.get("PREFIXGATE_DEVICE") == "cuda") == (variant == "gpu")
    # the KV events: vLLM's JSON our CLI accepts, ports published and named
    events = parse_kv_events_config(env["PREFIXGATE_KV_EVENTS_CONFIG"])
    assert events.enabled and events.endpoint == "tcp://*:5557"
    assert events.replay_endpoint == "tcp://*:5558"
    assert events.topic == ("kv@$(POD_IP)@smol" if variant == "everything" else "")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    # the router reaches every replica by its stable name, hashing as they do
    router = _by(objects, "Deployment", "router")
    router_env = _env(router["spec"]["template"]["spec"]["containers"][0])
    count = replicas["spec"]["replicas"]
    assert router_env["PREFIXGATE_REPLICA"].split(",") == [
        f"http://pg-prefixgate-replica-{i}.pg-prefixgate-replica:8000" for i in range(count)]
    for name in ("PREFIXGATE_PAGE_SIZE", "PREFIXGATE_HASH_SEED", "PREFIXGATE_REDIS_URL"):
        assert router_env[name] == env[name]
    redis = _by(objects, "Service", "redis")
    assert env["PREFIXGATE_REDIS_URL"] == f"redis://{redis['metadata']['name']}:6379/0"
    headless = _by(objects, "Service", "replica")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["metadata"]["name"] == replicas["spec"]["serviceName"]
    labels = pod["metadata"]["labels"]
    assert labels["llm-d.ai/inference-serving"] == "true"  # llm-d's pod discovery selector
    if variant == "cpu":
        return
    pool = next(o for o in objects if o["kind"] == "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    selected = [o for o in objects if o["kind"] == "Service" and
                monitor["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {
        "replica", "router"}
    assert all(any(p["name"] == "http" for p in s["spec"]["ports"]) for s in selected)
    # the EPP configuration names our block size, event port, discovery label and metrics
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    epp = yaml.safe_load(config["data"]["config.yaml"])
    scorer = next(p for p in epp["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == 16
    discovery = scorer["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]
    assert discovery["socketPort"] == ports["kv-events"]
    assert "llm-d.ai/inference-serving=true" in discovery["podLabelSelector"]
    metrics = yaml.safe_load(config["data"]["metrics.yaml"])
    assert set(metrics.values()) == {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                                     "vllm:num_requests_running", "vllm:cache_config_info"}
    json.dumps(objects)  # plain data all the way down


def test_the_checks_bite():
    """A misspelt field or a missing required one fails: the validation is not a formality."""
    objects = render({"inferencePool": {"enabled": True}})
    version = kubernetes_validate.latest_version()
    replicas = next(o for o in objects if o["kind"] == "StatefulSet")
    replicas["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(replicas, version, strict=True)
    pool = next(o for o in objects if o["kind"] == "InferencePool")
    del pool["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)
