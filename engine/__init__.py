"""The Pagoda inference engine. Never imports Django; only engine.protocol is shared with the web tier."""
