"""The tenant dashboard: server-rendered pages for members (keys, usage, limits, playground)."""
