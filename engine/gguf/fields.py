"""A GGUF file's typed metadata fields as Python values, and the one error the importer raises."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import EngineError


class GGUFImportError(EngineError):
    """The GGUF file cannot be imported: unreadable, or a model or encoding the engine does not serve."""


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):
        # GGUF stores float32; 9.999999747e-06 is the 1e-05 the model was trained with.
        value = float(np.float32(value).item())
        value = float(f"{value:.7g}")
    return value


def int_field(reader: Any, key: str, default: int | None = None) -> int:
    value = field_value(reader, key, default)
    if isinstance(value, list):
        # Some files give a per-layer list (head counts); the engine needs one value for all layers.
        if len(set(value)) != 1:
            raise GGUFImportError(f"{key} differs between layers ({sorted(set(value))}); not supported")
        value = value[0]
    if value is None:
        raise GGUFImportError(f"the GGUF file has no {key} field")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GGUFImportError(f"{key} must be a positive integer, got {value!r}")
    return value
