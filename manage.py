#!/usr/bin/env python
from __future__ import annotations

import os
import sys

# Commands that never touch Redis: they do not start the embedded server (REDIS_URL unset).
NO_REDIS_COMMANDS = {
    "check",
    "collectstatic",
    "help",
    "makemigrations",
    "migrate",
    "showmigrations",
    "sqlmigrate",
}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    from django.core.management import execute_from_command_line

    if len(sys.argv) > 1 and sys.argv[1] not in NO_REDIS_COMMANDS:
        from config.embedded_redis import start_if_configured

        start_if_configured()
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
