"""OpenAI's Responses API: translate (body in), render (answer out), views, schema."""
