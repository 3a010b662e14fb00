"""The Pagoda inference engine. Never imports Django; which of its modules the web tier may import is
listed once, in the import contracts of pyproject.toml."""
