"""POST /v1/embeddings: OpenAI's shape, over an embedding deployment's engines."""
