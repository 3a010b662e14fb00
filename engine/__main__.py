"""Command line: ``python -m engine <subcommand>``. A small dispatcher; each subcommand lives in its module."""

from __future__ import annotations

import argparse
import sys


def _make_model(args: argparse.Namespace) -> int:
    from engine.make_model import make_model

    path = make_model(args.out, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype)
    print(path)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from engine.serve import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from engine import serve
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
