"""deploy/ against the code and the config it names: what a user would meet on a real cluster
if the manifests drifted (a Serve application that cannot import, a policy given arguments it
does not take, bounds that disagree with the TOML, a secret written in plain text, a gateway
killed mid-drain, an ingress that cuts WebSockets after a minute). No cluster, no Ray needed;
the one test that asks Ray's own schema runs only where Ray is installed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from engine_cluster.config import ClusterConfig
from gateway.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
IMAGE_CONFIGS = "/app/configs/"  # Dockerfile: COPY configs /app/configs
SECRET_ENVS = ("ENGINE_CORE_SECRET", "GATEWAY_API_KEYS", "RAY_AUTH_TOKEN")
GCS_PORT = 6379
WEBSOCKET_TIMEOUT_S = 3600
NGINX = "nginx.ingress.kubernetes.io/"

Doc = dict[str, Any]


# --- reading the manifests --------------------------------------------------------------------


def load_documents() -> list[tuple[str, Doc]]:
    """(file name, document) for every YAML document under deploy/."""
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                out.append((path.name, doc))
    return out


@pytest.fixture(scope="module")
def documents() -> list[tuple[str, Doc]]:
    return load_documents()


def one(documents: list[tuple[str, Doc]], kind: str, file: str | None = None) -> Doc:
    """The one document of ``kind`` in deploy/ (in ``file``, when given)."""
    found = [doc for name, doc in documents if doc.get("kind") == kind and file in (None, name)]
    assert len(found) == 1, f"expected one {kind} in deploy/{file or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def rayservice(documents: list[tuple[str, Doc]]) -> Doc:
    return one(documents, "RayService")


@pytest.fixture(scope="module")
def serve_config(rayservice: Doc) -> Doc:
    """serveConfigV2: a YAML document inside a string, as KubeRay takes it."""
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


@pytest.fixture(scope="module")
def application(serve_config: Doc) -> Doc:
    apps = serve_config["applications"]
    assert len(apps) == 1
    return apps[0]


@pytest.fixture(scope="module")
def replica_deployment(application: Doc) -> Doc:
    (deployment,) = [d for d in application["deployments"] if d["name"] == "EngineReplica"]
    return deployment


def repo_path_of_image_config(path: str) -> Path:
    assert path.startswith(IMAGE_CONFIGS), f"{path} is not under {IMAGE_CONFIGS}, where the image holds configs/"
    return REPO / "configs" / path.removeprefix(IMAGE_CONFIGS)


@pytest.fixture(scope="module")
def config(application: Doc) -> Config:
    """The config the replicas and the gateway both read, loaded as the gateway loads it."""
    return load_config(repo_path_of_image_config(application["args"]["config"]))


@pytest.fixture(scope="module")
def gateway(documents: list[tuple[str, Doc]]) -> Doc:
    return one(documents, "Deployment")


@pytest.fixture(scope="module")
def gateway_container(gateway: Doc) -> Doc:
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    return container


def ray_pod_templates(rayservice: Doc) -> list[Doc]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def secret_ref(env: Doc) -> tuple[str, str]:
    ref = env["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def walk_env(node: Any) -> Iterator[Doc]:
    """Every entry of every ``env`` list anywhere in a document."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "env" and isinstance(value, list):
                yield from value
            else:
                yield from walk_env(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk_env(item)


def container_port(container: Doc, port: int | str) -> int:
    """A probe's or a Service's port, named or numbered, as the container's port number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def shell_script(container: Doc) -> str:
    return " ".join(container.get("command", []) + container.get("args", []))


def flag_value(script: str, flag: str) -> str:
    match = re.search(rf"{re.escape(flag)}[ =](\S+)", script)
    assert match, f"{flag} not in the gateway's command"
    return match.group(1)


def nginx_bytes(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kKmMgG]?)", size).groups()
    return int(number) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit.lower()]


def pre_stop_sleep_s(container: Doc) -> int:
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop.get("exec", {}).get("command", [])
    return int(command[-1]) if command[:1] == ["sleep"] else 0


def app_autoscaling_keys() -> set[str]:
    """The keys of the autoscaling_config dict literal in engine_cluster/app.py (read, not
    imported: app.py imports Ray at its top)."""
    tree = ast.parse((REPO / "engine_cluster" / "app.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and isinstance(node.targets[0], ast.Subscript)
                and ast.literal_eval(node.targets[0].slice) == "autoscaling_config"):
            return {ast.literal_eval(k) for k in node.value.keys if k is not None}
    raise AssertionError("engine_cluster/app.py no longer builds autoscaling_config as a dict literal")


# --- every file ---------------------------------------------------------------------------------


def test_every_document_parses_and_names_itself(documents: list[tuple[str, Doc]]) -> None:
    files = {name for name, _ in documents}
    assert {"engine-rayservice.yaml", "gateway.yaml", "limits-redis.yaml"} <= files
    for name, doc in documents:
        assert isinstance(doc, dict), f"{name}: a document that is not a mapping"
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), name
    kinds = sorted(doc["kind"] for _, doc in documents)
    assert kinds == sorted(["RayService", "NetworkPolicy", "Deployment", "Service", "Ingress",
                            "PodDisruptionBudget", "HorizontalPodAutoscaler",
                            "StatefulSet", "Service", "NetworkPolicy"])  # the limits' Redis


def test_no_secret_value_is_written_in_the_manifests(documents: list[tuple[str, Doc]]) -> None:
    assert not [doc for _, doc in documents if doc["kind"] == "Secret"], "secrets are created by hand (README)"
    seen = set()
    for name, doc in documents:
        for env in walk_env(doc):
            if env["name"] in SECRET_ENVS or re.search(r"SECRET|TOKEN|KEYS?$", env["name"]):
                assert "value" not in env, f"{name}: {env['name']} is written literally"
                assert "secretKeyRef" in env.get("valueFrom", {}), f"{name}: {env['name']} not from a Secret"
                seen.add(env["name"])
    assert set(SECRET_ENVS) <= seen


# --- the RayService -----------------------------------------------------------------------------


def test_the_serve_application_is_the_one_the_config_names(application: Doc, config: Config) -> None:
    assert repo_path_of_image_config(application["args"]["config"]).is_file()
    assert config.cluster.enabled
    assert application["name"] == config.cluster.app_name  # gateways find the replica directory by it
    assert application["route_prefix"] is None  # tokens go over the engine-core protocol, not Serve's HTTP


def test_import_path_names_build_app(application: Doc) -> None:
    module, _, attribute = application["import_path"].partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not importable"
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert attribute in functions, f"{module} has no top-level {attribute}"
    assert [a.arg for a in functions[attribute].args.args] == ["args"]  # Serve passes serveConfigV2's args


def test_policy_function_is_queue_kv_policy(replica_deployment: Doc) -> None:
    from engine_cluster.policy import QueueKvPolicy

    module, _, attribute = replica_deployment["autoscaling_config"]["policy"]["policy_function"].partition(":")
    assert getattr(importlib.import_module(module), attribute) is QueueKvPolicy


def test_policy_kwargs_are_the_policy_constructor_arguments(replica_deployment: Doc, config: Config) -> None:
    """Serve instantiates the class with these: each of its parameters given, with the config's
    values, and nothing it does not take (a stray key would fail the policy's construction)."""
    from engine_cluster.policy import QueueKvPolicy

    kwargs = replica_deployment["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs == config.cluster.policy_kwargs()
    json.dumps(kwargs)  # Serve requires JSON-serialisable kwargs
    parameters = inspect.signature(QueueKvPolicy.__init__).parameters.values()
    named = {p.name for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD}
    assert named == set(kwargs), f"the policy would fall back to its defaults for {named - set(kwargs)}"
    policy = QueueKvPolicy(**kwargs)
    assert (policy.target_queue, policy.target_kv, policy.headroom) == (
        kwargs["target_queue_per_replica"], kwargs["target_kv_use"], kwargs["scale_down_headroom"])


def test_the_deployment_options_mirror_the_cluster_table(replica_deployment: Doc, config: Config) -> None:
    """serveConfigV2 overrides what build_app derives from the TOML; the two must say the same."""
    cluster: ClusterConfig = config.cluster
    autoscaling = replica_deployment["autoscaling_config"]
    assert set(autoscaling) == app_autoscaling_keys()
    assert autoscaling["min_replicas"] == cluster.min_replicas
    assert autoscaling["max_replicas"] == cluster.max_replicas
    assert autoscaling["initial_replicas"] == cluster.initial_replicas
    for key in ("upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"):
        assert autoscaling[key] == getattr(cluster, key), key
    assert replica_deployment["ray_actor_options"] == {"num_cpus": cluster.replica_cpus, "num_gpus": cluster.replica_gpus}
    # Serve must not kill a replica that is still draining its running requests.
    assert replica_deployment["graceful_shutdown_timeout_s"] > cluster.drain_timeout_s


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")
def test_ray_serve_accepts_the_config_and_it_equals_deployment_options(
        serve_config: Doc, replica_deployment: Doc, config: Config) -> None:
    pytest.importorskip("ray.serve", reason="Ray is not installed (`make test-cluster` installs it)")
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from engine_cluster.app import deployment_options

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ServeDeploySchema.model_validate(serve_config)  # what the Serve controller does with it
        assert set(replica_deployment["autoscaling_config"]) <= set(AutoscalingConfig.model_fields)
    assert replica_deployment == deployment_options(config.cluster)


def test_the_gpu_worker_group_matches_the_serve_bounds(rayservice: Doc, config: Config) -> None:
    cluster_spec = rayservice["spec"]["rayClusterConfig"]
    assert cluster_spec["enableInTreeAutoscaling"] is True
    (group,) = cluster_spec["workerGroupSpecs"]
    # One replica per GPU pod: the autoscaler's bounds are Serve's.
    assert (group["minReplicas"], group["maxReplicas"]) == (config.cluster.min_replicas, config.cluster.max_replicas)
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    worker = group["template"]["spec"]["containers"][0]
    limits = worker["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == config.cluster.replica_gpus == 1
    assert float(limits["cpu"]) >= config.cluster.replica_cpus
    head = cluster_spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    head_container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})


def test_every_ray_container_gets_the_engine_secret(rayservice: Doc, gateway_container: Doc, config: Config) -> None:
    """A replica refuses to start without it; a gateway holding another value fails the HMAC."""
    name = config.engine.secret_env
    gateway_ref = secret_ref(env_of(gateway_container)[name])
    for template in ray_pod_templates(rayservice):
        for container in template["spec"]["containers"]:
            assert secret_ref(env_of(container)[name]) == gateway_ref, container["name"]


# --- the gateway --------------------------------------------------------------------------------


def test_the_gateway_joins_the_rayservice_head(rayservice: Doc, gateway_container: Doc, config: Config) -> None:
    head_service = f"{rayservice['metadata']['name']}-head-svc:{GCS_PORT}"
    assert config.cluster.ray_address == head_service  # what ray.init is given (it wins over $RAY_ADDRESS)
    assert env_of(gateway_container)["RAY_ADDRESS"]["value"] == head_service
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert GCS_PORT in [p["containerPort"] for p in head["ports"]]
    script = shell_script(gateway_container)
    assert "ray://" not in script + config.cluster.ray_address  # a driver, not Ray Client
    # Ray 2.60 attaches a driver only to a raylet on its own host: the pod is a node with no resources.
    assert "ray start" in script and "--num-cpus=0" in script and "--num-gpus=0" in script
    assert script.index("ray start") < script.index("-m gateway serve")
    auth = rayservice["spec"]["rayClusterConfig"].get("authOptions", {})
    if auth.get("mode", "disabled") == "token":
        env = env_of(gateway_container)
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert secret_ref(env["RAY_AUTH_TOKEN"]) == (auth["secretName"], "auth_token")


def test_the_gateway_serves_the_config_the_replicas_read(gateway: Doc, gateway_container: Doc,
                                                         application: Doc, config: Config) -> None:
    script = shell_script(gateway_container)
    assert "-m gateway serve" in script
    assert flag_value(script, "--config") == application["args"]["config"]
    assert flag_value(script, "--host") == "0.0.0.0"
    assert int(flag_value(script, "--port")) == container_port(gateway_container, "http")
    assert env_of(gateway_container)[config.server.api_keys_env]  # 0.0.0.0 is refused without keys
    assert gateway["spec"]["replicas"] == 2
    assert gateway["spec"]["template"]["metadata"]["labels"]["app"] == "rtgw-gateway"


def test_the_gateway_is_probed_and_drains_before_it_is_killed(gateway: Doc, gateway_container: Doc,
                                                              config: Config) -> None:
    readiness, liveness = gateway_container["readinessProbe"], gateway_container["livenessProbe"]
    assert readiness["httpGet"]["path"] == "/readyz"  # 503 while loading and while draining
    assert liveness["httpGet"]["path"] == "/healthz"
    for probe in (readiness, liveness):
        assert container_port(gateway_container, probe["httpGet"]["port"]) == 8000
    assert not config.server.operator_endpoints_need_key  # else the kubelet's probe gets 401
    sleep_s = pre_stop_sleep_s(gateway_container)
    assert sleep_s > 0  # the endpoint goes before the drain begins
    grace = gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > sleep_s + config.server.drain_timeout_s + config.server.shutdown_grace_s


def test_the_ingress_keeps_websockets_and_sse_open(documents: list[tuple[str, Doc]], gateway_container: Doc,
                                                   config: Config) -> None:
    ingress, service = one(documents, "Ingress"), one(documents, "Service", "gateway.yaml")
    annotations = ingress["metadata"]["annotations"]
    assert int(annotations[NGINX + "proxy-read-timeout"]) >= WEBSOCKET_TIMEOUT_S
    assert int(annotations[NGINX + "proxy-send-timeout"]) >= WEBSOCKET_TIMEOUT_S
    assert annotations[NGINX + "proxy-buffering"] == "off"  # SSE events pass as they come
    # gateway/process/server.py's body limit: nginx must not answer 413 to a body the gateway accepts.
    body_limit = max(1 << 20, 6 * config.server.max_conversation_chars + 65536)
    assert nginx_bytes(annotations[NGINX + "proxy-body-size"]) >= max(body_limit, config.server.max_frame_bytes)
    assert NGINX + "affinity" not in annotations  # sessions live on their gateway; reconnects restore by item id
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == backend["port"]["name"]]
    assert container_port(gateway_container, port["targetPort"]) == 8000


def test_service_pdb_hpa_and_network_policy_select_the_right_pods(documents: list[tuple[str, Doc]], gateway: Doc,
                                                                   rayservice: Doc) -> None:
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    service, pdb, hpa = one(documents, "Service", "gateway.yaml"), one(documents, "PodDisruptionBudget"), one(
        documents, "HorizontalPodAutoscaler")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["minAvailable"] == 1
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    policy = one(documents, "NetworkPolicy", "engine-rayservice.yaml")
    ray_labels = policy["spec"]["podSelector"]["matchLabels"]
    for template in ray_pod_templates(rayservice):
        assert ray_labels.items() <= template["metadata"]["labels"].items()
    sources = [peer.get("podSelector", {}).get("matchLabels") for rule in policy["spec"]["ingress"]
               for peer in rule["from"] if "namespaceSelector" not in peer]
    assert pod_labels.items() >= {"app": "rtgw-gateway"}.items() and {"app": "rtgw-gateway"} in sources
    assert ray_labels in sources  # Ray's own traffic between its pods
    gateway_rule = next(rule for rule in policy["spec"]["ingress"]
                        if {"podSelector": {"matchLabels": {"app": "rtgw-gateway"}}} in rule["from"])
    assert "ports" not in gateway_rule  # the engine cores listen on ephemeral ports


# --- the limits' Redis --------------------------------------------------------------------------


def test_the_gateway_config_points_at_the_limits_redis(documents: list[tuple[str, Doc]], config: Config) -> None:
    """The pods share one key space: the URL's host and port are the Service's, and the Service
    selects the StatefulSet's pods on the port Redis listens on."""
    statefulset = one(documents, "StatefulSet", "limits-redis.yaml")
    service = one(documents, "Service", "limits-redis.yaml")
    assert config.limits.backend == "redis"
    url = urlsplit(config.limits.url)
    assert url.scheme == "redis" and url.hostname == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"]
    pod = statefulset["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    (container,) = pod["spec"]["containers"]
    assert container_port(container, port["targetPort"]) == port["port"]
    assert not config.server.api_keys  # the config in the image holds no secret (the pods' keys come from a Secret)


def test_one_redis_without_persistence_evicting_what_expires_first(documents: list[tuple[str, Doc]]) -> None:
    """Two Redis pods behind one Service would split every key's limits; nothing in it outlives a
    minute or a lease's TTL, so nothing is saved; every key expires, so eviction takes the nearest
    expiry instead of failing writes."""
    statefulset = one(documents, "StatefulSet", "limits-redis.yaml")
    assert statefulset["spec"]["replicas"] == 1
    assert "volumeClaimTemplates" not in statefulset["spec"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl"
    assert container["readinessProbe"] and container["livenessProbe"]


def test_only_the_gateway_pods_reach_the_limits_redis(documents: list[tuple[str, Doc]], gateway: Doc) -> None:
    policy = one(documents, "NetworkPolicy", "limits-redis.yaml")
    statefulset = one(documents, "StatefulSet", "limits-redis.yaml")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= (
        statefulset["spec"]["template"]["metadata"]["labels"].items())
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer == {"podSelector": {"matchLabels": {"app": "rtgw-gateway"}}}
    assert peer["podSelector"]["matchLabels"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in rule["ports"]] == [6379]


def test_the_hpa_scales_the_gateway_pods_and_each_runs_one_worker(documents: list[tuple[str, Doc]],
                                                                  config: Config) -> None:
    """Pods scale out under the autoscaler (their limits shared through Redis); one worker a pod
    keeps the CPU the autoscaler measures one process's (server.workers: docs/configuration.md)."""
    hpa = one(documents, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert config.server.workers == 1
