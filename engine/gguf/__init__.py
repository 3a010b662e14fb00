"""GGUF import: llama.cpp / Ollama model files as model directories the engine serves."""

from engine.gguf.fields import GGUFImportError
from engine.gguf.importer import DTYPES, IMPORT_RECORD, import_gguf

__all__ = ["DTYPES", "IMPORT_RECORD", "GGUFImportError", "import_gguf"]
