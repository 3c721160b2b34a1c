"""deploy/kubernetes/ validated offline, since no cluster runs here: core kinds against Kubernetes'
own schemas (kubernetes-validate, strict: unknown fields fail), the Gateway API and Inference
Extension kinds against their CRDs' openAPIV3Schema vendored in deploy/kubernetes/schemas/ (source
and version in each file's $comment), unknown fields failing as kubectl's strict validation does.
Then the pieces must agree: the metric names the endpoint picker reads are the ones the handler
emits, the pool selects the replicas' pods on TorchServe's inference port, the probes hit /ping."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from orcaserve.handler.metrics import GATEWAY_METRICS

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"  # the oldest Kubernetes the Inference Extension v1.3 supports here
MODEL = "orca"  # the archive's name: orca.mar, /predictions/orca/..., ModelName="orca"


def _documents() -> list[dict]:
    return [d for path in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused wherever it lists an object's fields (an API
    server prunes them silently; kubectl --validate=strict refuses them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                if not node.get("x-kubernetes-preserve-unknown-fields"):
                    node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path in DEPLOY.glob("schemas/*.json"):
        schema = json.loads(path.read_text())
        out[(f"{schema['group']}/{schema['version']}", schema["kind"])] = _strict(schema)
    return out


def _find(kind: str, name: str) -> dict:
    [doc] = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_every_manifest_is_valid():
    crds = _crd_schemas()
    kinds = set()
    for doc in _documents():
        key = (doc["apiVersion"], doc["kind"])
        kinds.add(doc["kind"])
        if key in crds:
            jsonschema.validate(doc, crds[key])
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert {"Deployment", "Service", "InferencePool", "HTTPRoute", "Gateway", "ConfigMap"} <= kinds


def test_validation_catches_mistakes():
    crds = _crd_schemas()
    pool = copy.deepcopy(_find("InferencePool", "orcaserve"))
    pool["spec"]["extensionRef"] = pool["spec"]["endpointPickerRef"]  # v1alpha2's field name
    with pytest.raises(jsonschema.ValidationError, match="extensionRef"):
        jsonschema.validate(pool, crds[("inference.networking.k8s.io/v1", "InferencePool")])
    route = copy.deepcopy(_find("HTTPRoute", "orcaserve"))
    route["spec"]["rules"][0]["filters"][0]["urlRewrite"]["path"]["type"] = "ReplacePrefix"
    with pytest.raises(jsonschema.ValidationError, match="ReplacePrefix"):
        jsonschema.validate(route, crds[("gateway.networking.k8s.io/v1", "HTTPRoute")])
    deployment = copy.deepcopy(_find("Deployment", "orcaserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ping"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _properties() -> dict[str, str]:
    text = _find("ConfigMap", "orcaserve-config")["data"]["config.properties"]
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_endpoint_picker_reads_the_handlers_gauges():
    args = _find("Deployment", "orcaserve-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2]))
    for flag, metric in GATEWAY_METRICS.items():
        assert flags[f"--{flag}"] == f'{metric}{{ModelName="{MODEL}"}}', flag
    assert flags["--lora-info-metric"] == ""
    assert int(flags["--model-server-metrics-port"]) == _port(_properties()["metrics_address"])


def test_pool_serves_the_replicas():
    props = _properties()
    assert props["load_models"] == f"{MODEL}.mar" and props["metrics_mode"] == "prometheus"
    assert props["disable_token_authorization"] == "true"  # probes and the picker carry no token
    deployment = _find("Deployment", "orcaserve")
    pod = deployment["spec"]["template"]
    pool = _find("InferencePool", "orcaserve")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert pool["targetPorts"] == [{"number": ports["http"]}] and ports["http"] == _port(props["inference_address"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/ping", "port": "http"}, probe
    epp = _find("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp["spec"]["ports"]]
    route = _find("HTTPRoute", "orcaserve")["spec"]["rules"][0]
    assert route["backendRefs"][0]["name"] == "orcaserve" and route["backendRefs"][0]["kind"] == "InferencePool"
    rewrite = route["filters"][0]["urlRewrite"]["path"]["replacePrefixMatch"]
    assert rewrite == f"/predictions/{MODEL}/1.0/v1"
