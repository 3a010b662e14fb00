"""What the deployment tests share: reading and rendering the manifests, and what the code reads.

kubectl and kustomize need not be installed: `render` assembles a kustomization's resources the
way `kubectl kustomize` does for the fields the manifests use (resources, namespace, images), and
refuses a kustomization that uses any other field. Where kubectl is installed, a test compares the
two renderings.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())

# The fields of a kustomization that `render` applies; any other makes it refuse.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images"}
CLUSTER_SCOPED_KINDS = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}

# The settings helpers of config/env.py: a name they read may also be given as NAME_FILE.
ENV_HELPERS = {"envstr", "envbool", "envint", "envfloat", "envlist", "envsecret"}
# Directories whose Python is no process of a deployment (tests, benchmarks) or not the project's.
NOT_SCANNED = {"tests", "bench", "node_modules", "var", "media", "models", "static", "__pycache__"}

# Names a manifest may set that the project's code does not read: the interpreter, Django's
# start-up, or the native libraries under torch read them.
PROCESS_ENV = {
    "OMP_NUM_THREADS": "OpenMP's thread count (torch's CPU kernels and the engine's C kernels)",
    "HOME": "Path.home(): PAGODA_CACHE_DIR's default, Triton's cache, every library's dotfiles",
    "PYTHONUNBUFFERED": "the interpreter: logs reach the container runtime at once",
    "DJANGO_SETTINGS_MODULE": "Django's start-up (manage.py and config.asgi set its default)",
}
# Settings every process of the platform needs: without them it refuses to start (DEBUG off), or
# starts against the embedded SQLite database and redis-server, which a cluster must never use.
REQUIRED_SETTINGS = ("SECRET_KEY", "API_KEY_PEPPER", "DATABASE_URL", "REDIS_URL", "DEBUG")
# The components the manifests and docker-compose.yml run, by the processes they are.
PROCESS_COMPONENTS = ("web", "engine", "celery-worker", "celery-batches", "celery-beat", "migrate")


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    """Every YAML file under deploy/kubernetes that holds Kubernetes objects."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def load_kustomization(directory: Path) -> dict:
    (doc,) = load_documents(directory / "kustomization.yaml")
    return doc


def split_image(reference: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of an image reference; a registry's port is part of the name."""
    name, _, digest = reference.partition("@")
    tag = None
    head, sep, tail = name.rpartition(":")
    if sep and "/" not in tail:
        name, tag = head, tail
    return name, tag, digest or None


def _set_image(container: dict, images: list[dict]) -> None:
    name, tag, digest = split_image(container["image"])
    for image in images:
        if image["name"] != name:
            continue
        name = image.get("newName", name)
        if "newTag" in image:
            tag = str(image["newTag"])
        if "digest" in image:
            digest, tag = image["digest"], None
        break
    container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize DIRECTORY` prints, in the order of the resources."""
    kustomization = load_kustomization(directory)
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: tests/deploy/support.render does not apply {sorted(unknown)}"
    objects: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else load_documents(path)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED_KINDS:
                obj["metadata"]["namespace"] = namespace
    images = kustomization.get("images", [])
    for _, pod in pod_specs(objects):
        for container in pod.get("initContainers", []) + pod["containers"]:
            _set_image(container, images)
    return objects


def object_id(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def find(objects: list[dict], kind: str, name: str) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def get(objects: list[dict], kind: str, name: str) -> dict:
    obj = find(objects, kind, name)
    assert obj is not None, f"no {kind} {name}"
    return obj


def pod_specs(objects: list[dict]) -> Iterator[tuple[dict, dict]]:
    for obj in objects:
        if obj["kind"] in POD_TEMPLATE_KINDS:
            yield obj, obj["spec"]["template"]["spec"]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def labels_match(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector} uses more than matchLabels"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# The environment a container gets. A value is the literal string where the manifests give one;
# SECRET where it comes from a Secret, and None where Kubernetes computes it (resourceFieldRef).
SECRET = object()


def container_env(container: dict, objects: list[dict]) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            config_map = get(objects, "ConfigMap", source["configMapRef"]["name"])
            env.update({prefix + k: v for k, v in config_map.get("data", {}).items()})
        if "secretRef" in source:
            secret = get(objects, "Secret", source["secretRef"]["name"])
            keys = {**secret.get("data", {}), **secret.get("stringData", {})}
            env.update({prefix + k: SECRET for k in keys})
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = get(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            env[item["name"]] = SECRET
        else:
            env[item["name"]] = None
    return env


@dataclass(frozen=True)
class EnvReads:
    names: frozenset[str]  # read by some process of the platform
    file_capable: frozenset[str]  # read through config.env's helpers: NAME_FILE works too
    defaults: dict[str, tuple[str, Any]]  # helper and literal default, where the code gives one


def python_sources() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.py")
        if not any(part in NOT_SCANNED or part.startswith(".") for part in p.relative_to(ROOT).parts[:-1])
    )


def _literal_name(node: ast.Call) -> str | None:
    if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _constant(node: ast.AST) -> Any:
    """The value of a literal default (a constant, a list of them, or arithmetic on numbers)."""
    if isinstance(node, ast.BinOp):
        left, right = _constant(node.left), _constant(node.right)
        operators = {ast.Mult: lambda a, b: a * b, ast.Pow: lambda a, b: a**b, ast.Add: lambda a, b: a + b}
        return operators[type(node.op)](left, right)
    return ast.literal_eval(node)


@functools.cache
def code_env_reads() -> EnvReads:
    """The environment variables the project's Python reads with a literal name: through the
    config.env helpers, os.environ.get/[...]/setdefault, os.getenv, or `"NAME" in os.environ`."""
    names: set[str] = set()
    file_capable: set[str] = set()
    defaults: dict[str, tuple[str, Any]] = {}
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func, name = node.func, _literal_name(node)
                if name is None:
                    continue
                helper = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if helper in ENV_HELPERS:
                    names.add(name)
                    file_capable.add(name)
                    if len(node.args) > 1:
                        try:
                            defaults[name] = (helper, _constant(node.args[1]))
                        except (ValueError, KeyError, TypeError):
                            pass  # computed (a path under BASE_DIR): nothing literal to compare
                elif isinstance(func, ast.Attribute) and (
                    (_is_environ(func.value) and func.attr in {"get", "setdefault", "pop"})
                    or (func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os")
                ):
                    names.add(name)
            elif isinstance(node, ast.Subscript) and _is_environ(node.value):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    names.add(node.slice.value)
            elif (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Constant)
                and isinstance(node.left.value, str)
            ):
                if any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
                    _is_environ(c) for c in node.comparators
                ):
                    names.add(node.left.value)
    return EnvReads(frozenset(names), frozenset(file_capable), defaults)


def setting_of(env_name: str) -> str | None:
    """The setting an environment variable gives, or None if no code reads it."""
    reads = code_env_reads()
    if env_name.endswith("_FILE") and env_name.removesuffix("_FILE") in reads.file_capable:
        return env_name.removesuffix("_FILE")
    if env_name in reads.names or env_name in PROCESS_ENV:
        return env_name
    return None


def env_matches_default(value: str, helper: str, default: Any) -> bool:
    if helper == "envint":
        return int(value) == default
    if helper == "envfloat":
        return float(value) == float(default)
    if helper == "envbool":
        return (value.strip().lower() in {"1", "true", "yes", "on"}) == default
    if helper == "envlist":
        return [v.strip() for v in value.split(",") if v.strip()] == list(default)
    return value == default


def _argparse_default(path: Path, option: str) -> Any:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            if _literal_name(node) == option:
                return next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "default")
    raise AssertionError(f"{path} defines no option {option}")


def engine_drain_grace_default() -> float:
    """The drain grace of an engine replica whose deployment sets none (engine serve's default)."""
    return float(_argparse_default(ROOT / "engine" / "serve.py", "--drain-grace-s"))


def web_drain_grace(env: dict[str, Any], command: list[str]) -> float:
    """The drain grace of a web process: its --drain-grace-s, else PAGODA_WEB_DRAIN_GRACE_S, else
    the default config/web_server.py reads it with."""
    if "--drain-grace-s" in command:
        return float(command[command.index("--drain-grace-s") + 1])
    value = env.get("PAGODA_WEB_DRAIN_GRACE_S")
    if isinstance(value, str):
        return float(value)
    helper, default = code_env_reads().defaults["PAGODA_WEB_DRAIN_GRACE_S"]
    return float(default)


def _first_group(pattern: str, text: str) -> str:
    match = re.search(pattern, text, re.M)
    assert match, f"no match for {pattern!r}"
    return match.group(1)


def dockerfile_user() -> tuple[int, str]:
    """The uid and home directory of the Dockerfile's USER (made with useradd --create-home)."""
    text = (ROOT / "Dockerfile").read_text()
    user = _first_group(r"^USER\s+(\S+)", text)
    useradd = _first_group(rf"useradd ([^&\n]*\b{user}\b)", text)
    uid = int(_first_group(r"--uid (\d+)", useradd))
    assert "--create-home" in useradd
    return uid, f"/home/{user}"


def shell_command(argv: list[str], env: dict[str, str]) -> list[str]:
    """A compose command as the process it runs: `sh -c "exec ..."` unwrapped, and the
    ${NAME:-default} forms expanded from `env` ($$ is compose's escape of $)."""
    if argv[:2] != ["sh", "-c"]:
        return argv
    script = argv[2].replace("$$", "$")

    def expand(match: re.Match) -> str:
        return env.get(match.group(1)) or match.group(2) or ""

    script = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", expand, script)
    words = shlex.split(script)
    return words[1:] if words[:1] == ["exec"] else words


# What a container's command runs. Each returns the options it was given, having checked that the
# program exists and accepts them; AssertionError otherwise.


def manage_py_options(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """`python manage.py NAME ARGS`: NAME is a command of an installed app (or Django's), and its
    own parser accepts ARGS. Needs Django set up (pytest-django does it)."""
    from django.core.management import get_commands, load_command_class
    from django.core.management.base import CommandError

    assert argv[:2] == ["python", "manage.py"], argv
    name = argv[2]
    commands = get_commands()
    assert name in commands, f"manage.py has no command {name!r}"
    command = load_command_class(commands[name], name)
    try:
        options = vars(command.create_parser("manage.py", name).parse_args(argv[3:]))
    except CommandError as exc:  # Django's parser raises instead of exiting when not run from a shell
        raise AssertionError(f"manage.py {name} refuses {argv[3:]}: {exc}") from None
    return name, options


def web_server_options(argv: list[str]) -> Any:
    """`python -m config.web_server ARGS`: its parser accepts ARGS and the application exists."""
    from config.web_server import build_parser

    assert argv[:3] == ["python", "-m", "config.web_server"], argv
    try:
        args = build_parser().parse_args(argv[3:])
    except SystemExit:
        raise AssertionError(f"python -m config.web_server refuses {argv[3:]}") from None
    module, _, attribute = args.application.partition(":")
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.is_file(), f"no module {module}"
    assigned = {
        t.id
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert attribute in assigned, f"{module} defines no {attribute}"
    return args


def celery_options(argv: list[str]) -> tuple[str, dict[str, list[str]]]:
    """`celery -A config SUBCOMMAND ARGS`: config exposes the Celery app, and SUBCOMMAND knows every
    option in ARGS. Returns the subcommand and each option's values by its long name."""
    import click
    from celery import Celery
    from celery.bin.celery import celery as cli

    import config

    assert argv[:3] == ["celery", "-A", "config"], argv
    assert isinstance(config.celery_app, Celery)
    name, words = argv[3], argv[4:]
    subcommand = cli.get_command(click.Context(cli), name)
    assert subcommand is not None, f"celery has no subcommand {name!r}"
    params = {opt: p for p in subcommand.params for opt in (*p.opts, *p.secondary_opts)}
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-"):
            continue  # an argument (inspect's method)
        opt, has_value, value = word.partition("=")
        assert opt in params, f"celery {name} has no option {opt}"
        param = params[opt]
        if not has_value and not (getattr(param, "is_flag", False) or getattr(param, "count", False)):
            value = words[i]
            i += 1
        options.setdefault(param.name, []).append(value)
    return name, options
