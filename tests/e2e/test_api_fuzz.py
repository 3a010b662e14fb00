"""Schema-driven fuzzing of the running API: schemathesis reads GET /v1/openapi.json from a real
stack (daphne and one engine replica of a tiny random model) and sends every operation in it
requests generated from the schema, valid and invalid, with tenant A's key.

Every answer must be: no 5xx; a status, content type and body the schema documents for the
operation; and every error in OpenAI's shape, in a stream too (tests/e2e/api_fuzz_hooks.py, which
also keeps generation requests to a few tokens). The examples per operation are bounded and the
seed fixed, so a run repeats and takes a couple of minutes on two slow cores; change SEED (or
raise MAX_EXAMPLES) to explore further.

Schemathesis runs as its CLI: its pytest integration (`schemathesis.pytest.from_fixture`) does not
run under this project's pytest (it reads `Node._nodeid`, which pytest 9 no longer has).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.api_fuzz_hooks import MAX_MODEL_LEN
from tests.e2e.processes import ROOT
from tests.e2e.stack import ServingStack, served_world

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

MODEL = "e2e-tiny-fuzz"
# Test cases per operation in the fuzzing phase; the coverage phase adds its own deterministic ones
# (boundary values, missing and wrongly typed fields).
MAX_EXAMPLES = 100
SEED = 20241124
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "openai_shaped_errors",  # tests/e2e/api_fuzz_hooks.py
]
RUN_TIMEOUT_S = 480


@dataclass
class Fuzzed:
    stack: ServingStack
    raw_key: str


@pytest.fixture(scope="module")
def fuzzed(committed_db, e2e_model_dir, tmp_path_factory) -> Iterator[Fuzzed]:
    media = tmp_path_factory.mktemp("e2e-fuzz-media")  # where an accepted adapter upload would land
    with served_world(
        committed_db,
        tmp_path_factory,
        replica_ids=["a"],
        env={"PAGODA_MEDIA_DIR": str(media)},
        model=MODEL,
        model_dir=e2e_model_dir,
        max_model_len=MAX_MODEL_LEN,
        engine_settings={"num_blocks": 64, "max_num_seqs": 8},
        # No limit may refuse the fuzzer's requests: a 429 would hide what they reach.
        tenant_a={
            "allowed_models": [MODEL],
            "requests_per_minute": None,
            "tokens_per_minute": None,
            "max_concurrent_requests": None,
            "monthly_token_quota": None,
        },
    ) as (world, stack):
        yield Fuzzed(stack, world.raw_key_a)


def _config(base_url: str) -> str:
    checks = "\n".join(f"[checks.{name}]\nenabled = true" for name in CHECKS)
    return f"""
base-url = "{base_url}"
seed = {SEED}
request-timeout = 60
workers = 1
# Streams are read to their end ([DONE]): generation is bounded to a few events per sequence.
max-stream-events = 200
# Nothing is kept between runs: each one is the same.
cache.enabled = false

[generation]
mode = "all"
max-examples = {MAX_EXAMPLES}
no-shrink = true
# Unknown query parameters are refused (400), as unknown body fields are.
allow-extra-parameters = false

[phases]
coverage.enabled = true
fuzzing.enabled = true
stateful.enabled = false

[checks]
enabled = false
{checks}
"""


def _documented_operations(base_url: str) -> set[str]:
    """The operations of the schema ("METHOD /path"), the schema document's own aside."""
    with urllib.request.urlopen(base_url + "/v1/openapi.json", timeout=30) as response:
        paths = json.loads(response.read())["paths"]
    return {
        f"{method.upper()} {path}"
        for path, ops in paths.items()
        for method in ops
        if path != "/v1/openapi.json"
    }


def test_every_operation_answers_as_its_schema_says(fuzzed: Fuzzed, tmp_path: Path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(_config(fuzzed.stack.base_url))
    junit = tmp_path / "junit.xml"

    result = subprocess.run(
        [
            str(Path(sys.executable).with_name("schemathesis")),
            "--config-file",
            str(config),
            "run",
            fuzzed.stack.base_url + "/v1/openapi.json",
            "--header",
            f"Authorization: Bearer {fuzzed.raw_key}",
            "--report",
            "junit",
            "--report-junit-path",
            str(junit),
        ],
        cwd=tmp_path,
        env={
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.e2e.api_fuzz_hooks",
            "PAGODA_FUZZ_MODEL": MODEL,
            "PYTHONPATH": str(ROOT),
            "NO_COLOR": "1",
        },
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    suite = ET.parse(junit).getroot()
    tested = {case.get("name") for case in suite.iter("testcase")}
    assert tested == _documented_operations(fuzzed.stack.base_url), output
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0"), output


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/adapters", "/detokenize"])
def test_a_malformed_multipart_body_is_answered_by_the_api_in_its_shape(fuzzed: Fuzzed, path: str):
    # Found by the fuzzer: Twisted parsed such bodies itself and answered a bare, empty 400.
    request = urllib.request.Request(
        fuzzed.stack.base_url + path,
        data=b'{"model": "x"}',
        method="POST",
        headers={"Authorization": f"Bearer {fuzzed.raw_key}", "Content-Type": "multipart/form-data"},
    )

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)

    assert refused.value.code == 400
    assert refused.value.headers["x-request-id"]
    assert json.loads(refused.value.read())["error"]["type"] == "invalid_request_error"
