"""deploy/kubernetes checked offline: the API schemas, yamllint, the kustomizations, and the drift
between the manifests and the code (settings, commands, probes, drains, Redis streams).

No cluster, kubectl or kustomize is needed (tests/deploy/support.py renders the kustomizations);
where kubectl is installed, its rendering is compared with ours.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse, urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.support import (
    BASE,
    ENV_HELPERS,
    K8S,
    OVERLAYS,
    PROCESS_COMPONENTS,
    REQUIRED_SETTINGS,
    ROOT,
    celery_options,
    code_env_reads,
    component,
    container_env,
    dockerfile_user,
    engine_drain_grace_default,
    env_matches_default,
    find,
    get,
    labels_match,
    load_documents,
    load_kustomization,
    manage_py_options,
    manifest_files,
    object_id,
    pod_specs,
    render,
    setting_of,
    shell_command,
    split_image,
    web_drain_grace,
    web_server_options,
)

# The Kubernetes versions deploy/kubernetes/README.md names: the oldest and the newest we support.
KUBERNETES_VERSIONS = ("1.30", "1.34")
KEDA_SCHEMAS = {
    "ScaledObject": K8S / "schemas" / "scaledobject-keda-v1alpha1.json",
    "TriggerAuthentication": K8S / "schemas" / "triggerauthentication-keda-v1alpha1.json",
}
# What deploy/kubernetes/README.md applies before the migrations Job runs: the Job and what it
# needs (one component at a time: kubectl apply's --selector takes equality only).
FIRST_APPLY_COMPONENTS = ("shared", "migrate")
# Settings of config/settings.py that the ConfigMap leaves out.
NOT_IN_CONFIGMAP = {
    "CELERY_BROKER_URL": "REDIS_URL's server by default",
    "PAGODA_ENGINE_HEALTH_PORT": "set on the engine containers, the only ones that serve it",
    "PAGODA_ALLOW_DEV_SECRETS": "development and tests only",
    "CELERY_TASK_ALWAYS_EAGER": "tests only",
    "PAGODA_TEST_DB_NAME": "tests only",
}
# ConfigMap values that differ from the code's defaults on purpose.
DELIBERATE_OVERRIDES = {
    "ALLOWED_HOSTS": "the public host, the web Service (KEDA's scrapes) and the probes' Host",
    "CSRF_TRUSTED_ORIGINS": "the public origin",
    "BEHIND_TLS_PROXY": "a cluster serves through a TLS-terminating Ingress",
}


@functools.cache
def _renderings() -> dict[str, list[dict]]:
    return {"base": render(BASE), **{overlay.name: render(overlay) for overlay in OVERLAYS}}


def renderings() -> dict[str, list[dict]]:
    return copy.deepcopy(_renderings())


def containers(objects: list[dict]):
    """(pod owner, pod spec, container) of every container the objects run."""
    for owner, pod in pod_specs(objects):
        for container in pod.get("initContainers", []) + pod["containers"]:
            yield owner, pod, container


def volume_of(pod: dict, mount: dict) -> dict:
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


def mounts_at(pod: dict, container: dict, path: str) -> list[tuple[dict, dict]]:
    return [(m, volume_of(pod, m)) for m in container.get("volumeMounts", []) if m["mountPath"] == path]


def engine_model(container: dict) -> str:
    name, options = manage_py_options(container["command"] + container.get("args", []))
    assert name == "run_engine"
    return options["model"]


def pod_labels(owner: dict) -> dict:
    return owner["spec"]["template"]["metadata"]["labels"]


def secret_values(objects: list[dict]) -> dict[str, str]:
    secret = get(objects, "Secret", "pagoda-secrets")
    return {**secret.get("data", {}), **secret.get("stringData", {})}


# The schemas.


def _manifest_documents() -> list[tuple[str, dict]]:
    return [
        (f"{path.relative_to(K8S)}#{i}", doc)
        for path in manifest_files()
        for i, doc in enumerate(load_documents(path))
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_strictly_against_the_kubernetes_api_schemas(version):
    checked = 0
    for where, doc in _manifest_documents():
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{where} ({doc['kind']}) is invalid for Kubernetes {version}: {path}: {exc.message}")
        checked += 1
    assert checked >= 20


def _strict(schema: Any) -> Any:
    """A CRD's schema as the API server applies it with strict field validation (kubectl's
    default): an object with declared properties takes no others."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


def test_keda_objects_validate_against_the_kept_crd_schemas():
    keda = [(where, doc) for where, doc in _manifest_documents() if doc["apiVersion"].startswith("keda.sh/")]
    assert {doc["kind"] for _, doc in keda} == set(KEDA_SCHEMAS)
    for where, doc in keda:
        assert doc["apiVersion"] == "keda.sh/v1alpha1", where
        schema = _strict(json.loads(KEDA_SCHEMAS[doc["kind"]].read_text()))
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
        assert not errors, f"{where}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), where


def test_the_strict_keda_schema_refuses_a_misspelt_field():
    schema = _strict(json.loads(KEDA_SCHEMAS["ScaledObject"].read_text()))
    (doc,) = load_documents(OVERLAYS[0] / "engine-scaledobject.yaml")
    doc["spec"]["minReplicas"] = 1
    assert not jsonschema.Draft7Validator(schema).is_valid(doc)


def test_the_kept_keda_schemas_name_their_source():
    notes = (K8S / "schemas" / "README.md").read_text()
    assert "8b4f083ca8c8c2baf8477e322bd4d16ac4dfa09a" in notes
    assert "github.com/kedacore/keda" in notes and "Apache License 2.0" in notes
    for path in KEDA_SCHEMAS.values():
        assert path.name in notes


def test_yamllint_passes_on_the_kubernetes_manifests():
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(file=str(K8S / ".yamllint"))
    paths = sorted(K8S.rglob("*.yaml")) + [K8S / ".yamllint"]
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column}: {p.desc} ({p.rule})"
        for path in paths
        for p in linter.run(path.read_text(), config, str(path))
    ]
    assert not problems, "\n".join(problems)


# The kustomizations.


def test_every_file_a_kustomization_lists_exists_and_every_manifest_is_listed():
    for directory in [BASE, *OVERLAYS]:
        listed = load_kustomization(directory).get("resources", [])
        files = {entry for entry in listed if not (directory / entry).is_dir()}
        for entry in listed:
            assert (directory / entry).exists(), f"{directory.relative_to(K8S)} lists {entry}: missing"
        present = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
        assert present == files, f"{directory.relative_to(K8S)}: not listed {present - files}"
    # No manifest outside a kustomization's directory, where no apply would find it.
    assert {path.parent for path in manifest_files()} <= {BASE, *OVERLAYS}


def test_overlays_build_on_the_base_and_pin_the_same_image():
    assert {overlay.name for overlay in OVERLAYS} == {"gpu-model", "cpu-model"}
    pagoda_images = set()
    for overlay in OVERLAYS:
        kustomization = load_kustomization(overlay)
        assert (overlay / kustomization["resources"][0]).resolve() == BASE.resolve()
        for _, _, container in containers(render(overlay)):
            name, tag, digest = split_image(container["image"])
            assert (tag or digest) and tag != "latest", f"{overlay.name}: {container['image']} is not pinned"
        images = {image["name"]: image for image in kustomization["images"]}
        pagoda_images.add(json.dumps(images["pagoda"], sort_keys=True))
    # Both overlays apply the base into one namespace: they must not pull its pods two ways.
    assert len(pagoda_images) == 1


def test_rendered_objects_are_unique_and_live_in_the_namespace():
    for name, objects in renderings().items():
        ids = [object_id(o) for o in objects]
        assert len(ids) == len(set(ids)), f"{name}: duplicates"
        (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
        for obj in objects:
            if obj["kind"] != "Namespace":
                assert obj["metadata"]["namespace"] == namespace["metadata"]["name"], object_id(obj)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_our_rendering_is_what_kubectl_kustomize_prints():
    for directory in [BASE, *OVERLAYS]:
        out = subprocess.run(
            ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        theirs = {object_id(doc): doc for doc in yaml.safe_load_all(out) if doc}
        ours = {object_id(doc): doc for doc in render(directory)}
        assert ours == theirs, directory.name


def test_every_reference_between_objects_resolves():
    for name, objects in renderings().items():
        for owner, pod in pod_specs(objects):
            where = f"{name}: {owner['metadata']['name']}"
            assert labels_match(owner["spec"].get("selector", {}), pod_labels(owner)), where
            assert find(objects, "ServiceAccount", pod["serviceAccountName"]), where
            for volume in pod.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert find(
                        objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
                    )
                if "secret" in volume:
                    secret = find(objects, "Secret", volume["secret"]["secretName"])
                    assert secret, where
                    for item in volume["secret"].get("items", []):
                        assert item["key"] in secret_values(objects), where
            for container in pod["containers"]:
                container_env(container, objects)  # every envFrom source exists
        pods = [pod_labels(owner) for owner, _ in pod_specs(objects)]
        for obj in objects:
            kind, spec = obj["kind"], obj.get("spec", {})
            if kind == "Service":
                assert any(labels_match({"matchLabels": spec["selector"]}, p) for p in pods), obj
            if kind in ("PodDisruptionBudget", "NetworkPolicy"):
                selector = spec.get("selector") or spec.get("podSelector")
                if selector and name != "base":  # the base has no engines for their policy
                    assert any(labels_match(selector, p) for p in pods), (name, obj["metadata"]["name"])
            if kind == "HorizontalPodAutoscaler" or kind == "ScaledObject":
                target = spec["scaleTargetRef"]
                assert target.get("kind", "Deployment") == "Deployment"
                assert find(objects, "Deployment", target["name"]), obj["metadata"]["name"]


def test_each_overlay_runs_every_process_of_the_platform():
    for overlay in OVERLAYS:
        found = {component(owner) for owner, _ in pod_specs(render(overlay))}
        assert found == set(PROCESS_COMPONENTS), overlay.name


# The settings.


def test_every_environment_variable_a_manifest_sets_is_read_by_the_code():
    for name, objects in renderings().items():
        for owner, _, container in containers(objects):
            for env_name in container_env(container, objects):
                assert setting_of(env_name), (
                    f"{name}: {owner['metadata']['name']} sets {env_name}, which no code reads"
                )


def test_the_configmap_holds_only_settings_the_code_reads():
    (config_map,) = load_documents(BASE / "configmap.yaml")
    for key in config_map["data"]:
        assert setting_of(key) and not key.endswith("_FILE"), key
    # Development switches have no place in a cluster.
    for key in ("PAGODA_ALLOW_DEV_SECRETS", "CELERY_TASK_ALWAYS_EAGER", "PAGODA_TEST_DB_NAME"):
        assert key not in config_map["data"]


def test_the_configmap_or_the_secret_holds_every_setting_of_the_settings_module():
    (config_map,) = load_documents(BASE / "configmap.yaml")
    given = set(config_map["data"]) | set(secret_values(render(BASE)))
    read = {
        node.args[0].value
        for node in ast.walk(ast.parse((ROOT / "config" / "settings.py").read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ENV_HELPERS
        and isinstance(node.args[0], ast.Constant)
    }
    missing = read - given - set(NOT_IN_CONFIGMAP)
    assert not missing, f"settings an operator cannot see in base/configmap.yaml: {sorted(missing)}"
    assert set(NOT_IN_CONFIGMAP) <= read


def test_the_configmap_restates_the_code_defaults_except_where_it_means_otherwise():
    (config_map,) = load_documents(BASE / "configmap.yaml")
    defaults = code_env_reads().defaults
    for key, value in config_map["data"].items():
        if key in DELIBERATE_OVERRIDES or key not in defaults:
            continue
        helper, default = defaults[key]
        assert env_matches_default(value, helper, default), (
            f"{key}={value!r}, the code's default is {default!r}"
        )
    for key in DELIBERATE_OVERRIDES:
        assert key in config_map["data"], key


def test_every_process_gets_the_settings_it_needs_and_debug_is_off():
    for name, objects in renderings().items():
        for owner, _, container in containers(objects):
            env = container_env(container, objects)
            settings = {setting_of(k) for k in env}
            missing = [s for s in REQUIRED_SETTINGS if s not in settings]
            assert not missing, f"{name}: {owner['metadata']['name']} lacks {missing}"
            assert env["DEBUG"] == "false"


def test_secrets_are_read_from_files_of_the_mounted_secret():
    for name, objects in renderings().items():
        secrets = secret_values(objects)
        for owner, pod, container in containers(objects):
            env = container_env(container, objects)
            for secret in (
                "SECRET_KEY",
                "API_KEY_PEPPER",
                "DATABASE_URL",
                "REDIS_URL",
                "PAGODA_METRICS_TOKEN",
            ):
                assert secret not in env, f"{owner['metadata']['name']}: {secret} in the environment"
            for env_name, path in env.items():
                if not env_name.endswith("_FILE"):
                    continue
                directory, key = path.rsplit("/", 1)
                ((mount, volume),) = mounts_at(pod, container, directory)
                assert mount.get("readOnly") is True
                items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])}
                assert items.get(key, key) == env_name.removesuffix("_FILE") and key in secrets, (name, path)


def test_secret_placeholders_stop_a_process_that_starts_with_them(monkeypatch):
    from config.env import ImproperlyConfiguredEnv, envsecret

    secrets = secret_values(render(BASE))
    # Empty: an SMTP server without a login; no single sign-on.
    optional = {"PAGODA_EMAIL_PASSWORD", "PAGODA_OIDC_CLIENT_SECRET"}
    for key, value in secrets.items():
        assert "REPLACE-ME" in value or key == "REDIS_ADDRESS" or (key in optional and value == ""), (
            f"{key} is no marked placeholder"
        )
    for key in ("SECRET_KEY", "API_KEY_PEPPER"):
        monkeypatch.setenv(key, secrets[key])
        with pytest.raises(ImproperlyConfiguredEnv):
            envsecret(key, "development default")


# Commands, probes, drains.


def test_every_container_runs_a_command_that_exists_with_arguments_it_accepts():
    from django.conf import settings

    routed_queues = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    for name, objects in renderings().items():
        consumed = set()
        for owner, _, container in containers(objects):
            argv = container["command"] + container.get("args", [])
            kind = component(owner)
            if kind == "web":
                web_server_options(argv)
            elif kind in ("engine", "migrate"):
                command, _ = manage_py_options(argv)
                assert command == {"engine": "run_engine", "migrate": "migrate"}[kind]
            else:
                subcommand, options = celery_options(argv)
                assert subcommand == ("beat" if kind == "celery-beat" else "worker"), kind
                consumed |= set(",".join(options.get("queues", ["celery"])).split(","))
            probe = container.get("livenessProbe", {}).get("exec")
            if probe:
                celery_options(shell_command(probe["command"], {}))
        assert routed_queues | {"celery"} <= consumed, (
            f"{name}: no worker consumes {routed_queues - consumed}"
        )


def test_web_probes_ask_for_paths_the_web_serves_with_a_host_it_allows():
    from django.http.request import validate_host
    from django.urls import resolve

    objects = render(BASE)
    deployment = find(objects, "Deployment", "pagoda-web")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    allowed = container_env(container, objects)["ALLOWED_HOSTS"].split(",")
    from inference.health import READY_SCOPES

    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        paths[probe] = get["path"]
        url = urlsplit(get["path"])
        assert resolve(url.path).func.__module__ == "inference.health", get["path"]
        assert all(value in READY_SCOPES for value in parse_qs(url.query).get("scope", [])), get["path"]
        (host,) = [h["value"] for h in get["httpHeaders"] if h["name"] == "Host"]
        assert validate_host(host, allowed), host
        assert get["port"] in {p["name"] for p in container["ports"]}
    # Readiness of this process only: a model without engines must not take every web pod out of
    # the Service (and with them every other model, and the /metrics that KEDA reads).
    assert paths == {"startupProbe": "/live", "livenessProbe": "/live", "readinessProbe": "/ready?scope=web"}


def test_engine_probes_ask_the_health_port_for_the_paths_the_engine_serves():
    health = (ROOT / "engine" / "worker" / "health.py").read_text()
    served = set(re.findall(r'^(?:LIVE|READY)_PATH = "([^"]+)"', health, re.M))
    assert served == {"/live", "/ready"}
    for overlay in OVERLAYS:
        objects = render(overlay)
        engines = [(o, c) for o, _, c in containers(objects) if component(o) == "engine"]
        assert engines
        for _, container in engines:
            (port,) = [p for p in container["ports"] if p["name"] == "health"]
            assert container_env(container, objects)["PAGODA_ENGINE_HEALTH_PORT"] == str(
                port["containerPort"]
            )
            paths = {
                probe: container[probe]["httpGet"]
                for probe in ("startupProbe", "livenessProbe", "readinessProbe")
            }
            assert {p: get["path"] for p, get in paths.items()} == {
                "startupProbe": "/live",
                "livenessProbe": "/live",
                "readinessProbe": "/ready",
            }
            assert all(get["port"] == "health" for get in paths.values())


def test_a_large_model_has_half_an_hour_to_load_on_a_gpu():
    objects = render(K8S / "overlays" / "gpu-model")
    (container,) = [c for o, _, c in containers(objects) if component(o) == "engine"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_cpu_engine_runs_one_thread_per_core_of_its_limit():
    objects = render(K8S / "overlays" / "cpu-model")
    (container,) = [c for o, _, c in containers(objects) if component(o) == "engine"]
    (omp,) = [e for e in container["env"] if e["name"] == "OMP_NUM_THREADS"]
    ref = omp["valueFrom"]["resourceFieldRef"]
    assert (ref["containerName"], ref["resource"], str(ref["divisor"])) == (
        container["name"],
        "limits.cpu",
        "1",
    )
    resources = container["resources"]
    # A whole number of cores, requested as limited (Guaranteed: the static CPU manager pins them).
    assert re.fullmatch(r"\d+", str(resources["limits"]["cpu"]))
    assert resources["requests"] == resources["limits"]


def test_pods_get_longer_than_their_drain_before_sigkill():
    engine_drain = engine_drain_grace_default()
    for name, objects in renderings().items():
        for owner, pod in pod_specs(objects):
            kind = component(owner)
            if kind not in ("web", "engine"):
                continue
            (container,) = pod["containers"]
            grace = pod["terminationGracePeriodSeconds"]
            if kind == "web":
                pre_stop = container["lifecycle"]["preStop"]
                sleep = (
                    pre_stop["sleep"]["seconds"]
                    if "sleep" in pre_stop
                    else int(pre_stop["exec"]["command"][-1])
                )
                assert pre_stop.get("exec", {}).get("command", ["sleep"])[0] == "sleep"
                drain = web_drain_grace(container_env(container, objects), container["command"])
                assert grace > sleep + drain, f"{name}: web {grace} <= {sleep} + {drain}"
            else:
                assert grace > engine_drain, f"{name}: {owner['metadata']['name']} {grace} <= {engine_drain}"


def test_rollouts_and_evictions_never_leave_a_process_without_a_ready_pod():
    for name, objects in renderings().items():
        for owner, _ in pod_specs(objects):
            kind = component(owner)
            if owner["kind"] != "Deployment":
                continue
            strategy = owner["spec"]["strategy"]
            if kind == "celery-beat":
                # Exactly one beat, ever.
                assert strategy["type"] == "Recreate" and owner["spec"]["replicas"] == 1
                continue
            assert strategy["rollingUpdate"]["maxUnavailable"] == 0, owner["metadata"]["name"]
            if kind in ("web", "engine"):
                budgets = [
                    o
                    for o in objects
                    if o["kind"] == "PodDisruptionBudget"
                    and labels_match(o["spec"]["selector"], pod_labels(owner))
                ]
                assert budgets, f"{name}: no PodDisruptionBudget for {owner['metadata']['name']}"
                # Autoscaled: the HPA (or KEDA's) owns the count, which an apply must not reset.
                assert "replicas" not in owner["spec"], owner["metadata"]["name"]


# Security.


def test_every_pod_runs_restricted_as_the_image_user():
    uid, home = dockerfile_user()
    for name, objects in renderings().items():
        for owner, pod in pod_specs(objects):
            where = f"{name}: {owner['metadata']['name']}"
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] == uid, where
            assert context["seccompProfile"]["type"] == "RuntimeDefault", where
            assert pod["automountServiceAccountToken"] is False, where
            # The Service pagoda-web would put PAGODA_WEB_* variables into the settings' namespace.
            assert pod["enableServiceLinks"] is False, where
            assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
            assert not any("hostPath" in v for v in pod.get("volumes", [])), where
            for container in pod["containers"]:
                sc = container["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
                assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged"), where


def test_every_container_can_write_where_the_processes_write():
    uid, home = dockerfile_user()
    for name, objects in renderings().items():
        for owner, pod, container in containers(objects):
            where = f"{name}: {owner['metadata']['name']}"
            env = container_env(container, objects)
            assert env["HOME"] == home, where
            for path in ("/tmp", home):
                ((mount, volume),) = mounts_at(pod, container, path)
                assert "emptyDir" in volume and not mount.get("readOnly"), (where, path)
            # The image's collected static files (PAGODA_VAR_DIR/static) stay visible.
            assert not mounts_at(pod, container, env["PAGODA_VAR_DIR"]), where
            if component(owner) == "celery-beat":
                _, options = celery_options(container["command"])
                (schedule,) = options["schedule"]
                ((_, volume),) = mounts_at(pod, container, str(Path(schedule).parent))
                assert "emptyDir" in volume


def test_shared_volumes_are_mounted_where_the_settings_point():
    writes_media = {"web", "celery-worker", "celery-batches"}
    reads_models = {"web", "celery-worker", "celery-batches", "engine"}
    for name, objects in renderings().items():
        claims = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PersistentVolumeClaim"}
        assert claims["pagoda-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]
        assert claims["pagoda-media"]["spec"]["accessModes"] == ["ReadWriteMany"]
        for owner, pod, container in containers(objects):
            kind, env = component(owner), container_env(container, objects)
            media = mounts_at(pod, container, env["PAGODA_MEDIA_DIR"])
            models = mounts_at(pod, container, env["PAGODA_MODELS_DIR"])
            if kind in writes_media | {"engine"}:
                ((mount, volume),) = media
                assert volume["persistentVolumeClaim"]["claimName"] == "pagoda-media"
                assert bool(mount.get("readOnly")) == (kind == "engine"), (name, kind)
            if kind in reads_models:
                ((mount, volume),) = models
                assert volume["persistentVolumeClaim"] == {"claimName": "pagoda-models", "readOnly": True}
                assert mount["readOnly"] is True


def test_network_policies_let_only_the_web_pods_take_connections():
    objects = render(OVERLAYS[0])
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (deny,) = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"} and "ingress" not in deny["spec"]
    open_ports: dict[str, set[int]] = {}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            for owner, _ in pod_specs(objects):
                if labels_match(policy["spec"]["podSelector"], pod_labels(owner)):
                    open_ports.setdefault(component(owner), set()).update(p["port"] for p in rule["ports"])
    assert open_ports == {"web": {8000}, "engine": {8001}}
    egress = {
        p["port"] for policy in policies for rule in policy["spec"].get("egress", []) for p in rule["ports"]
    }
    assert egress == {53, 5432, 6379}


# Autoscaling.


def test_scaled_objects_watch_the_request_stream_of_the_model_their_engine_serves():
    from django.http.request import validate_host
    from django.urls import resolve

    from engine.protocol import CONSUMER_GROUP, requests_stream

    for overlay in OVERLAYS:
        objects = render(overlay)
        secrets = secret_values(objects)
        redis_url = urlparse(secrets["REDIS_URL"])
        scaled = [o for o in objects if o["kind"] == "ScaledObject"]
        assert scaled, overlay.name
        for so in scaled:
            spec = so["spec"]
            deployment = find(objects, "Deployment", spec["scaleTargetRef"]["name"])
            (container,) = deployment["spec"]["template"]["spec"]["containers"]
            env = container_env(container, objects)
            model = engine_model(container)
            assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
            triggers = {t["type"]: t for t in spec["triggers"]}
            if spec["minReplicaCount"] == 0:
                # Woken by the queue: a request must wait for the first replica (the deployment's
                # replica wait, set where the README registers the model) and make KEDA start one.
                assert re.search(
                    rf"model_register \\\n\s+--name {re.escape(model)} .*--replica-wait-seconds [1-9]",
                    (K8S / "README.md").read_text(),
                ), f"{model}: scaled to zero but registered without a replica wait"
                assert int(triggers["redis-streams"]["metadata"]["activationLagCount"]) == 0
                assert float(triggers["metrics-api"]["metadata"]["activationTargetValue"]) == 0
            assert set(triggers) == {"redis-streams", "metrics-api"}

            redis = triggers["redis-streams"]["metadata"]
            assert redis["stream"] == requests_stream(env["PAGODA_REDIS_PREFIX"], model)
            assert redis["consumerGroup"] == CONSUMER_GROUP
            assert int(redis["lagCount"]) > 0 and int(redis["activationLagCount"]) >= 0
            assert int(redis["databaseIndex"]) == int(redis_url.path.lstrip("/") or 0)
            auth = find(
                objects, "TriggerAuthentication", triggers["redis-streams"]["authenticationRef"]["name"]
            )
            refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
            assert secrets[refs["address"]["key"]] == f"{redis_url.hostname}:{redis_url.port}"
            assert secrets[refs["password"]["key"]] == redis_url.password

            metrics = triggers["metrics-api"]["metadata"]
            assert metrics["format"] == "prometheus" and metrics["authMode"] == "bearer"
            assert metrics["valueLocation"] == f'pagoda_queue_depth{{model="{model}"}}'
            assert float(metrics["targetValue"]) > 0
            url = urlparse(metrics["url"])
            service_name, namespace, svc = url.hostname.split(".")
            service = find(objects, "Service", service_name)
            assert (
                svc == "svc" and namespace == so["metadata"]["namespace"] == service["metadata"]["namespace"]
            )
            assert url.port in {p["port"] for p in service["spec"]["ports"]}
            web_deployment = find(objects, "Deployment", service_name)
            assert labels_match({"matchLabels": service["spec"]["selector"]}, pod_labels(web_deployment))
            assert resolve(url.path).func.__name__ == "metrics"
            assert validate_host(url.hostname, env["ALLOWED_HOSTS"].split(","))
            auth = find(
                objects, "TriggerAuthentication", triggers["metrics-api"]["authenticationRef"]["name"]
            )
            (token,) = auth["spec"]["secretTargetRef"]
            # The very token the web pods check.
            (web,) = web_deployment["spec"]["template"]["spec"]["containers"]
            web_token_path = container_env(web, objects)["PAGODA_METRICS_TOKEN_FILE"]
            assert (token["parameter"], token["name"]) == ("bearerToken", "pagoda-secrets")
            assert web_token_path.endswith("/" + token["key"])


def test_the_gauge_the_scaled_objects_read_is_one_the_web_exports():
    source = (ROOT / "inference" / "metrics.py").read_text()
    for overlay in OVERLAYS:
        for so in (o for o in render(overlay) if o["kind"] == "ScaledObject"):
            for trigger in so["spec"]["triggers"]:
                if trigger["type"] == "metrics-api":
                    metric = trigger["metadata"]["valueLocation"].split("{")[0]
                    assert f'"{metric}"' in source, metric


def test_no_other_autoscaler_fights_keda_over_an_engine():
    for overlay in OVERLAYS:
        objects = render(overlay)
        keda = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "ScaledObject"}
        hpa = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
        engines = {o["metadata"]["name"] for o, _ in pod_specs(objects) if component(o) == "engine"}
        assert keda == engines and not keda & hpa
        assert hpa == {"pagoda-web"}


def test_the_engine_triggers_can_read_the_secret_they_name():
    for overlay in OVERLAYS:
        objects = render(overlay)
        secrets = secret_values(objects)
        for auth in (o for o in objects if o["kind"] == "TriggerAuthentication"):
            for ref in auth["spec"]["secretTargetRef"]:
                assert find(objects, "Secret", ref["name"]) and ref["key"] in secrets, ref
    # Both overlays may be applied to one namespace: their shared objects must agree.
    shared: dict[tuple, str] = {}
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if obj["kind"] == "TriggerAuthentication":
                text = json.dumps(obj, sort_keys=True)
                assert shared.setdefault(object_id(obj), text) == text


# The README.


def test_the_first_apply_of_the_readme_brings_what_the_migrations_job_needs():
    readme = (K8S / "README.md").read_text()
    for name in FIRST_APPLY_COMPONENTS:
        assert f"-l 'app.kubernetes.io/component={name}'" in readme
    wanted = set(FIRST_APPLY_COMPONENTS)
    for overlay in OVERLAYS:
        objects = render(overlay)
        first = [o for o in objects if component(o) in wanted]
        (job,) = [o for o in first if o["kind"] == "Job"]
        pod = job["spec"]["template"]["spec"]
        needed = {("ServiceAccount", pod["serviceAccountName"]), ("Namespace", job["metadata"]["namespace"])}
        needed |= {("Secret", v["secret"]["secretName"]) for v in pod["volumes"] if "secret" in v}
        needed |= {("ConfigMap", s["configMapRef"]["name"]) for s in pod["containers"][0]["envFrom"]}
        # Its way out to PostgreSQL: every policy that selects it comes with it.
        needed |= {
            ("NetworkPolicy", o["metadata"]["name"])
            for o in objects
            if o["kind"] == "NetworkPolicy" and labels_match(o["spec"]["podSelector"], pod_labels(job))
        }
        assert needed <= {(o["kind"], o["metadata"]["name"]) for o in first}
        namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
        assert f"kubectl -n {namespace} wait --for=condition=complete job/{name}" in readme
        assert f"kubectl -n {namespace} delete job {name} --ignore-not-found" in readme


def test_the_readme_names_the_validated_kubernetes_versions_and_its_examples_validate():
    readme = (K8S / "README.md").read_text()
    for version in KUBERNETES_VERSIONS:
        assert version in readme
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    assert blocks
    for block in blocks:
        for doc in yaml.safe_load_all(block):
            if doc and "apiVersion" in doc and not doc["apiVersion"].startswith("keda.sh/"):
                for version in KUBERNETES_VERSIONS:
                    kubernetes_validate.validate(doc, version, strict=True)


def test_secret_values_are_given_as_text():
    # stringData, never base64 data: the placeholders stay readable and greppable.
    (secret,) = load_documents(BASE / "secret.yaml")
    assert "data" not in secret and all(isinstance(v, str) for v in secret["stringData"].values())
