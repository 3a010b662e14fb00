"""Per-request sampling parameters, with vLLM's names and defaults and OpenAI's ranges.

They arrive over the wire (the web tier ships them to the engine as JSON), so every field is
checked on construction and a bad one raises `SamplingParamsError` naming the field, which the
API reports as OpenAI's `param`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from engine.rules import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from engine.structured_output.spec import StructuredOutputsError, structured_outputs_check

# Below this temperature sampling is argmax: dividing logits by ~0 would only overflow.
_SAMPLING_EPS = 1e-5
# logit_bias keys: token ids written in ASCII digits (a vocabulary is far below 10**10 tokens).
MAX_TOKEN_ID_DIGITS = 10
_TOKEN_ID_KEY = re.compile(rf"[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}")
# Integers cross the wire as JSON and are read into 64-bit tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The ranges of the numeric parameters, (low, high, low excluded): checked on construction, and
# shown in the API's OpenAPI schema, which reads them from here.
NUMBER_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    # As vLLM: any positive value (1 is off; > 1 discourages repeats, < 1 encourages them).
    "repetition_penalty": (0.0, math.inf, True),
}
INTEGER_RANGES: dict[str, tuple[int | None, int | None]] = {
    "n": (1, MAX_N),
    "top_k": (-1, INT64_MAX),  # -1 or 0: off
    "seed": (INT64_MIN, INT64_MAX),
    "min_tokens": (0, None),
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
}


class SamplingParamsError(ValueError):
    """A sampling parameter is missing, of the wrong type or out of range."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    # bool is an int subclass; `max_tokens=True` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise SamplingParamsError(name, f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _check_float(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise SamplingParamsError(name, f"{name} must be in {bracket}{lo}, {hi}], got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be a boolean, got {value!r}")
    return value


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (stored as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    # Top logprobs per output token, 0..20; 0 returns only the sampled token's logprob.
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (vLLM's prompt_logprobs), 0..20 top entries each; computed in
    # the prefill's forward passes, so a request asking for them does not reuse the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Added to the logits of these token ids (OpenAI's logit_bias, -100..100) before sampling.
    logit_bias: dict[int, float] | None = None
    # A grammar the output must match (vLLM's structured_outputs: json, regex, choice, grammar or
    # json_object); kept canonical, see engine.structured_output.spec.
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name, (lo, hi, lo_open) in NUMBER_RANGES.items():
            setattr(self, name, _check_float(name, getattr(self, name), lo, hi, lo_open=lo_open))
        for name, (ilo, ihi) in INTEGER_RANGES.items():
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _check_int(name, value, lo=ilo, hi=ihi))
        if self.top_k == -1:
            self.top_k = 0
        self.stop = self._checked_stop(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of integers")
        self.stop_token_ids = [_check_int("stop_token_ids", t, lo=0) for t in self.stop_token_ids]
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.max_tokens = _check_int("max_tokens", self.max_tokens, lo=1)
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.logit_bias = self._checked_logit_bias(self.logit_bias)
        try:
            self.structured_outputs = structured_outputs_check(self.structured_outputs)
        except StructuredOutputsError as exc:
            raise SamplingParamsError(exc.param, str(exc)) from exc

    @staticmethod
    def _checked_logit_bias(bias: Any) -> dict[int, float] | None:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(bias)}"
            )
        out: dict[int, float] = {}
        for key, value in bias.items():
            # JSON object keys are strings: a bias crosses the wire as {"123": 5.0}. str.isdigit()
            # also takes "²" and "١", which int() refuses or reads as another number; the length
            # bound keeps int() from reading thousands of digits.
            if isinstance(key, str):
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise SamplingParamsError(
                        "logit_bias",
                        f"logit_bias keys must be token ids (ASCII digits, at most {MAX_TOKEN_ID_DIGITS}),"
                        f" got {key[:32]!r}",
                    )
                key = int(key)
            out[_check_int("logit_bias", key, lo=0)] = _check_float(
                "logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS
            )
        return out

    @staticmethod
    def _checked_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise SamplingParamsError("stop", "stop must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}"
            )
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"each stop string must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError(
                    "stop",
                    f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}",
                )
        return list(stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (lists copied, so the caller may mutate it)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
        if self.logit_bias is not None:
            out["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Inverse of to_dict; missing fields take their defaults, unknown ones are refused."""
        if not isinstance(data, dict):
            raise SamplingParamsError("sampling_params", "sampling params must be an object")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise SamplingParamsError(str(key), f"unknown sampling parameter {key!r}")
        return cls(**data)
