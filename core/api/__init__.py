"""The API layer's shared parts: rendering every error in OpenAI's shape, the /v1 catch-all."""
