"""What every Django app shares: the error hierarchy and its one renderer, the Redis client,
request ids and the /v1 catch-all. No models of its own; imports no app."""
