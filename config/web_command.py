"""The command line of a web process (`python -m config.web_server`) on 127.0.0.1, for what starts
one: the benchmarks' stack and the end-to-end tests. A module of its own: importing
config.web_server installs Twisted's reactor in the importing process."""

from __future__ import annotations

import sys


def web_command(port: int, *options: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "config.web_server",
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
        *options,
        "config.asgi:application",
    ]
