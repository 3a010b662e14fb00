"""The Pagoda inference engine. Never imports Django; the web tier imports only engine.protocol, engine.rules
and engine.chat_template."""
