"""API keys parsing, ServerSettings validation, and the CLI's flag ↔ environment mirroring."""

from __future__ import annotations

import dataclasses
import json

import pytest

from prefixgate.engine.config import SERVE_KV_TIER, STEP_TOKEN_BUDGET, EngineConfig
from prefixgate.engine.setting import env_var
from prefixgate.gateway import cli
from prefixgate.gateway.http.api_keys import load_api_keys_file, merge_api_keys, parse_api_key
from prefixgate.gateway.server.settings import ServerSettings


def test_env_var_names():
    assert env_var("--kv-memory") == "PREFIXGATE_KV_MEMORY"
    assert env_var("--api-keys-file") == "PREFIXGATE_API_KEYS_FILE"


def test_parse_api_key():
    assert parse_api_key("sk-1") == ("sk-1", "default")
    assert parse_api_key("sk-1:team-a") == ("sk-1", "team-a")
    with pytest.raises(ValueError, match="empty tenant"):
        parse_api_key("sk-1:")
    with pytest.raises(ValueError, match="invalid API key"):
        parse_api_key("has space")


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"k1": "a", "k2": "b"}),
        json.dumps([{"key": "k1", "tenant": "a"}, "k2:b"]),
        "# keys\nk1 a\n\nk2   b  # trailing comment\n",
    ],
)
def test_keys_file_formats(tmp_path, text):
    path = tmp_path / "keys"
    path.write_text(text)
    assert load_api_keys_file(path) == {"k1": "a", "k2": "b"}


def test_keys_file_errors_name_the_place(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("k1 a\nk2 b c\n")
    with pytest.raises(ValueError, match=r"keys\.txt:2"):
        load_api_keys_file(path)
    path.write_text("k1 a\nk1 b\n")
    with pytest.raises(ValueError, match="duplicate"):
        load_api_keys_file(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_api_keys_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys_file(tmp_path / "missing")


def test_merge_conflicting_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k1 a\n")
    assert merge_api_keys(["k2:b"], path) == {"k1": "a", "k2": "b"}
    with pytest.raises(ValueError, match="different tenants"):
        merge_api_keys(["k1:z"], path)


def test_settings_validation_and_auth_switch():
    assert not ServerSettings().auth_enabled
    assert ServerSettings(admin_key="adm").auth_enabled
    assert ServerSettings(api_keys={"k": "t"}).auth_enabled
    with pytest.raises(ValueError, match="port"):
        ServerSettings(port=70000)
    with pytest.raises(ValueError, match="admin key must differ"):
        ServerSettings(api_keys={"k": "t"}, admin_key="k")
    keys = {"k": "t"}
    settings = ServerSettings(api_keys=keys)
    keys["other"] = "x"  # the settings took a copy
    assert dict(settings.api_keys) == {"k": "t"}
    with pytest.raises(TypeError):
        settings.api_keys["z"] = "y"  # type: ignore[index]


def resolve(argv: list[str], env: dict[str, str]):
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    return cli.configs(cli.resolve(args, parser, env))


def test_cli_defaults():
    engine, settings = resolve(["serve"], {})
    assert engine.model is None and engine.page_size == 16 and engine.num_pages is None
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)
    assert not settings.auth_enabled and settings.allowed_origins == ()


def test_env_mirrors_every_flag_and_cli_wins(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("fk ftenant\n")
    env = {
        "PREFIXGATE_KV_MEMORY": "2.5",
        "PREFIXGATE_PORT": "9001",
        "PREFIXGATE_PAGE_SIZE": "32",
        "PREFIXGATE_MAX_NUM_BATCHED_TOKENS": "512",
        "PREFIXGATE_MAX_WAITING": "7",
        "PREFIXGATE_API_KEY": "k1:a, k2",
        "PREFIXGATE_API_KEYS_FILE": str(keys),
        "PREFIXGATE_ADMIN_KEY": "adm",
        "PREFIXGATE_SERVED_MODEL_NAME": "smol",
        "PREFIXGATE_HASH_SEED": "42",
    }
    engine, settings = resolve(["serve"], env)
    assert engine.kv_memory_gb == 2.5 and engine.page_size == 32
    assert (
        engine.max_num_batched_tokens == 512 and engine.max_waiting == 7 and engine.hash_seed == 42
    )
    assert engine.served_model_name == settings.served_model_name == "smol"
    assert settings.port == 9001 and settings.admin_key == "adm"
    assert dict(settings.api_keys) == {"k1": "a", "k2": "default", "fk": "ftenant"}
    engine, settings = resolve(["serve", "--port", "9002", "--api-key", "only"], env)
    assert settings.port == 9002
    assert dict(settings.api_keys) == {
        "only": "default",
        "fk": "ftenant",
    }  # the flag replaces the env list


def test_every_serve_flag_has_a_default_entry():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    dests = {a.dest for a in sub.choices["serve"]._actions if a.option_strings and a.dest != "help"}
    assert dests == set(cli.DEFAULTS)


def test_no_flag_means_the_configs_own_defaults():
    engine, settings = resolve(["serve"], {})
    # one deliberate difference: the server runs the auto-sized tier, an embedded engine none
    assert engine == dataclasses.replace(EngineConfig(), kv_tier=SERVE_KV_TIER)
    assert settings == ServerSettings()


def _help(parser, command: str) -> str:
    sub = next(a for a in parser._actions if a.dest == "command")
    return " ".join(sub.choices[command].format_help().split())


def test_help_reads_its_defaults_from_the_configs():
    """The help once said the CPU step budget defaults to 256 where the config said 192: every
    default in the help is now filled in from the values ``resolve`` falls back to."""
    parser = cli.build_parser()
    serve, route = _help(parser, "serve"), _help(parser, "route")
    assert "{default}" not in serve and "{default}" not in route
    assert (
        f"(default {STEP_TOKEN_BUDGET['cpu']} on CPU, {STEP_TOKEN_BUDGET['cuda']} on GPU)" in serve
    )
    assert f"running sequences at once (default {EngineConfig().max_num_seqs})" in serve
    assert f"then HTTP 429 (default {EngineConfig().max_waiting})" in serve
    assert "get 413, by Content-Length before reading or counted for chunked bodies (default 32MiB;" in serve
    assert "plus headers over SIZE get 400 (default 64KiB)" in route
    assert "times its load (default 1.5)" in route


def test_bad_env_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        resolve(["serve"], {"PREFIXGATE_PORT": "eighty"})
    assert "PREFIXGATE_PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        resolve(["serve"], {"PREFIXGATE_KV_MEMORY": "1", "PREFIXGATE_NUM_PAGES": "10"})
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-memory", "1", "--num-pages", "10"])


def test_scheduling_knobs_reach_the_engine_config():
    engine, _ = resolve(["serve", "--decode-step-budget", "128", "--admission-order", "fcfs"],
                        {"PREFIXGATE_PROTECT_WAITING": "off", "PREFIXGATE_MAX_ADMISSION_WAIT": "9"})
    assert (engine.decode_step_budget, engine.admission_order) == (128, "fcfs")
    assert engine.protect_waiting is False and engine.max_admission_wait_s == 9.0
    default, _ = resolve(["serve"], {})
    assert (default.protect_waiting, default.admission_order) == (True, "lpm")


def test_watermark_and_prefix_caching_reach_the_engine_config():
    engine, _ = resolve(["serve", "--watermark", "0.25"], {"PREFIXGATE_PREFIX_CACHING": "off"})
    assert engine.watermark == 0.25 and engine.enable_prefix_caching is False
    engine, _ = resolve(["serve"], {})
    assert engine.watermark == 0.10 and engine.enable_prefix_caching is True
    with pytest.raises(SystemExit):
        resolve(["serve", "--watermark", "1.5"], {})


def test_native_kernels_switch_spellings_and_flag_wins():
    for spelling in ("off", "OFF", "0", "false", "no"):
        engine, _ = resolve(["serve"], {"PREFIXGATE_NATIVE_KERNELS": spelling})
        assert engine.native_kernels is False
    engine, _ = resolve(["serve"], {})
    assert engine.native_kernels is True
    engine, _ = resolve(["serve", "--native-kernels", "on"], {"PREFIXGATE_NATIVE_KERNELS": "0"})
    assert engine.native_kernels is True
    engine, _ = resolve(["serve"], {"PREFIXGATE_PREFIX_CACHING": "False"})
    assert engine.enable_prefix_caching is False
    with pytest.raises(SystemExit):
        resolve(["serve"], {"PREFIXGATE_NATIVE_KERNELS": "maybe"})


def test_kv_tier_flags_reach_the_engine_config(tmp_path):
    engine, _ = resolve(["serve"], {})  # the server's default: a host tier sized at start
    assert engine.kv_tier == "auto" and engine.kv_tier_size_gb == 4.0
    assert resolve(["serve", "--kv-tier", "off"], {})[0].kv_tier is None
    path = str(tmp_path / "tier.bin")
    engine, _ = resolve(["serve", "--kv-tier", "host", "--kv-tier-size", "0.5", "--kv-tier-path", path], {})
    assert (engine.kv_tier, engine.kv_tier_size_gb, engine.kv_tier_path) == ("host", 0.5, path)
    engine, _ = resolve(["serve"], {"PREFIXGATE_KV_TIER": "redis"})
    assert engine.kv_tier == "redis"


def test_retention_flags_reach_the_configs():
    engine, settings = resolve(["serve"], {})
    assert settings.retention_learn is True and engine.retention_tenant_budget == 0.25
    engine, settings = resolve(["serve", "--retention-tenant-budget", "0.1"],
                               {"PREFIXGATE_RETENTION_LEARN": "off"})
    assert settings.retention_learn is False and engine.retention_tenant_budget == 0.1


def test_speculative_tokens_flag_reaches_the_engine_config():
    engine, _ = resolve(["serve"], {})
    assert engine.num_speculative_tokens == 4
    engine, _ = resolve(["serve", "--speculative-tokens", "0"], {})
    assert engine.num_speculative_tokens == 0
    engine, _ = resolve(["serve"], {"PREFIXGATE_SPECULATIVE_TOKENS": "8"})
    assert engine.num_speculative_tokens == 8



def test_kv_dtype_flag_reaches_the_engine_config(capsys):
    engine, _ = resolve(["serve"], {})
    assert engine.kv_dtype is None  # auto: the model's dtype, the pool as before
    engine, _ = resolve(["serve", "--kv-dtype", "auto"], {})
    assert engine.kv_dtype is None
    engine, _ = resolve(["serve", "--kv-dtype", "bf16"], {})
    assert engine.kv_dtype == "bf16"
    engine, _ = resolve(["serve", "--kv-dtype", "fp32"], {"PREFIXGATE_KV_DTYPE": "bf16"})
    assert engine.kv_dtype == "fp32"  # the flag wins
    engine, _ = resolve(["serve"], {"PREFIXGATE_KV_DTYPE": "fp16"})
    assert engine.kv_dtype == "fp16"
    with pytest.raises(SystemExit):
        resolve(["serve", "--kv-dtype", "int8"], {})
    assert "--kv-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        resolve(["serve"], {"PREFIXGATE_KV_DTYPE": "bfloat8"})
    assert "PREFIXGATE_KV_DTYPE" in capsys.readouterr().err


def test_quantized_weights_flag_reaches_the_engine_config():
    engine, _ = resolve(["serve"], {})
    assert engine.quantized_weights is True
    engine, _ = resolve(["serve"], {"PREFIXGATE_QUANTIZED_WEIGHTS": "off"})
    assert engine.quantized_weights is False


def test_dtype_flag_reaches_the_engine_config(capsys):
    engine, _ = resolve(["serve"], {})
    assert engine.dtype is None  # auto: fp32 on CPU (exact), bf16 on GPU
    engine, _ = resolve(["serve", "--dtype", "auto"], {})
    assert engine.dtype is None
    engine, _ = resolve(["serve"], {"PREFIXGATE_DTYPE": "bf16"})
    assert engine.dtype == "bf16"
    engine, _ = resolve(["serve", "--dtype", "fp32"], {"PREFIXGATE_DTYPE": "bf16"})
    assert engine.dtype == "fp32"  # the flag wins
    with pytest.raises(SystemExit):
        resolve(["serve", "--dtype", "int8"], {})
    assert "--dtype" in capsys.readouterr().err


def test_bf16_on_a_cpu_without_bf16_instructions_is_a_usage_error(monkeypatch, capsys):
    from prefixgate.engine import precision

    monkeypatch.setattr(precision, "bf16_instructions", lambda: None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--device", "cpu", "--dtype", "bf16"], {})
    assert exit_info.value.code == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert "AVX512-BF16 or AMX-BF16" in err and "--dtype fp32" in err


def test_the_redis_tier_needs_its_secret():
    from prefixgate.gateway.server.launch import tier_store

    engine, settings = resolve(["serve", "--kv-tier", "redis", "--redis-url", "redis://127.0.0.1:1/0"], {})
    with pytest.raises(SystemExit, match="--kv-tier-secret"):
        tier_store(engine, settings)
    engine, settings = resolve(["serve", "--kv-tier", "redis", "--redis-url", "redis://127.0.0.1:1/0"],
                               {"PREFIXGATE_KV_TIER_SECRET": "short"})
    with pytest.raises(SystemExit, match="at least 16"):
        tier_store(engine, settings)
    engine, settings = resolve(["serve", "--kv-tier", "redis", "--redis-url", "redis://127.0.0.1:1/0"],
                               {"PREFIXGATE_KV_TIER_SECRET": "a-long-enough-fleet-secret"})
    assert tier_store(engine, settings).name == "redis"  # (connects lazily)
