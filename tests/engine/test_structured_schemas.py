"""The structured-output schema corpus against xgrammar, without a model.

A random-weight model picks arbitrary tokens, so each schema's grammar is walked token by token with
three stand-ins for it (a seeded random choice, always the highest allowed id, always the lowest)
and two tokenizers (the real SmolLM2 one and the tiny byte-level BPE one of make_model). Every walk
must reach the end of sequence within MAX_STEPS tokens and decode to JSON that the schema accepts.
"""

from __future__ import annotations

import json
import math
import random
import re._parser  # the stdlib regex parser: its getwidth() bounds what a pattern can match
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr

from tests.structured_schemas import SCHEMAS, schema_names

SMOLLM2_DIR = Path.home() / ".cache" / "pagoda" / "models" / "smollm2-135m-instruct-float32"
MAX_STEPS = 256
MAX_OUTPUT_BYTES = 200
# xgrammar writes a bounded number with at most six fraction digits and no exponent.
MAX_FRACTION_DIGITS = 6
STRATEGIES = ("random", "highest_id", "lowest_id")
INVALID_SCHEMAS = [
    ({"type": "strin"}, 'Unsupported type "strin"'),
    ({"type": "string", "pattern": "(["}, "Regex parsing error at position 3: Unclosed '\\['"),
    ({"$ref": "#/$defs/missing"}, "Cannot find field \\$defs in #/\\$defs/missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Invalid range: minimum greater than maximum"),
    (
        {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 1},
        "minItems is greater than maxItems",
    ),
]


@dataclass(frozen=True, slots=True)
class Vocab:
    tokenizer: Any
    vocab_size: int
    eos_id: int
    compiler: xgr.GrammarCompiler


def _vocab(model_dir: Path, eos_id: Callable[[Any], int]) -> Vocab:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = eos_id(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    # The compiler caches compiled grammars, so the three walks of a schema compile it once.
    return Vocab(tokenizer, vocab_size, eos, xgr.GrammarCompiler(info, max_threads=1))


@pytest.fixture(scope="session")
def smollm2_vocab() -> Vocab:
    if not SMOLLM2_DIR.is_dir():
        pytest.skip(f"the SmolLM2 checkpoint is not at {SMOLLM2_DIR}")
    return _vocab(SMOLLM2_DIR, lambda tok: tok.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture(scope="session")
def tiny_bpe_vocab(tiny_llama_dir: Path) -> Vocab:
    return _vocab(tiny_llama_dir, lambda tok: tok.eos_token_id)


def _allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    # Bit j of int32 word w stands for token 32 * w + j: with the words laid out little-endian, that is
    # bit j % 8 of byte 4 * w + j // 8. numpy, because torch's bit ops are slow on a busy machine.
    packed = bitmask_row.numpy().astype("<i4", copy=False).view(np.uint8)  # (4 * num_words,)
    bits = np.unpackbits(packed, bitorder="little")[:vocab_size]  # (vocab_size,)
    return np.flatnonzero(bits).tolist()


def _picker(strategy: str, seed: str) -> Callable[[list[int]], int]:
    if strategy == "random":
        return random.Random(seed).choice
    if strategy == "highest_id":
        return lambda ids: ids[-1]
    return lambda ids: ids[0]


def _walk(vocab: Vocab, schema: dict[str, Any], pick: Callable[[list[int]], int]) -> list[int]:
    """The tokens of one path through the schema's grammar, the end of sequence left out."""
    grammar = vocab.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab.vocab_size)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        matcher.fill_next_token_bitmask(bitmask, 0)
        token = pick(_allowed_ids(bitmask[0], vocab.vocab_size))
        assert matcher.accept_token(token)
        if token == vocab.eos_id:
            assert matcher.is_terminated()
            return tokens
        tokens.append(token)
    pytest.fail(f"no end of sequence within {MAX_STEPS} tokens: {_decode(vocab, tokens)!r}")


def _decode(vocab: Vocab, tokens: list[int]) -> str:
    # Exactly the text the grammar matched: no special tokens dropped, no spaces tidied away.
    return vocab.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/"), ref
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _max_bytes(schema: dict[str, Any], root: dict[str, Any]) -> int:
    """An upper bound on the UTF-8 bytes, hence tokens, of any output; fails on anything unbounded."""
    if "$ref" in schema:
        return _max_bytes(_resolve(root, schema["$ref"]), root)
    if "const" in schema:
        return _json_bytes(schema["const"])
    if "enum" in schema:
        return max(map(_json_bytes, schema["enum"]))
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return max(_max_bytes(branch, root) for branch in schema[combinator])
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return max(_max_bytes_of_type(kind, schema, root) for kind in types)


def _max_bytes_of_type(kind: str, schema: dict[str, Any], root: dict[str, Any]) -> int:
    if kind in ("null", "boolean"):
        return len("false")
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        assert low is not None and high is not None, f"an unbounded {kind}: {schema}"
        digits = max(len(str(math.floor(low))), len(str(math.ceil(high))))  # the sign and integer part
        return digits if kind == "integer" else digits + 1 + MAX_FRACTION_DIGITS
    if kind == "string":
        # maxLength alone is not enough: xgrammar then allows raw control characters, which are not JSON.
        assert "pattern" in schema, f"a string without a pattern: {schema}"
        assert schema["pattern"].isascii(), schema["pattern"]
        width = re._parser.parse(schema["pattern"]).getwidth()[1]
        assert width <= MAX_OUTPUT_BYTES, f"an unbounded pattern: {schema['pattern']}"
        return 2 + width
    if kind == "array":
        assert schema["maxItems"] <= 4, schema
        prefix = schema.get("prefixItems", [])
        items = [prefix[i] if i < len(prefix) else schema["items"] for i in range(schema["maxItems"])]
        return 2 + sum(len(", ") + _max_bytes(item, root) for item in items)
    assert kind == "object", kind
    assert schema["additionalProperties"] is False, f"an object open to more properties: {schema}"
    return 2 + sum(
        len(", ") + _json_bytes(key) + len(": ") + _max_bytes(value, root)
        for key, value in schema["properties"].items()
    )


def test_the_corpus_holds_at_least_sixty_uniquely_named_schemas() -> None:
    names = schema_names()

    assert len(names) >= 60
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(("name", "schema"), SCHEMAS, ids=schema_names())
def test_corpus_schema_is_valid_and_bounded_to_a_short_output(name: str, schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)

    assert _max_bytes(schema, schema) <= MAX_OUTPUT_BYTES


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tokenizer", ["smollm2", "tiny_bpe"])
@pytest.mark.parametrize(("name", "schema"), SCHEMAS, ids=schema_names())
def test_every_walk_through_the_grammar_ends_in_json_the_schema_accepts(
    request: pytest.FixtureRequest, name: str, schema: dict[str, Any], tokenizer: str, strategy: str
) -> None:
    vocab: Vocab = request.getfixturevalue(f"{tokenizer}_vocab")

    tokens = _walk(vocab, schema, _picker(strategy, seed=name))

    instance = json.loads(_decode(vocab, tokens))
    jsonschema.Draft202012Validator(schema, format_checker=None).validate(instance)


@pytest.mark.parametrize(("schema", "message"), INVALID_SCHEMAS)
def test_xgrammar_refuses_an_invalid_schema(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        xgr.Grammar.from_json_schema(json.dumps(schema))
