"""The Anthropic Messages API (/v1/messages): a second wire format over the one chat generation."""
