"""POST /v1/completions, OpenAI's legacy Completions: the body's parser (into the one generation
plan), the renderers of the one event stream (a whole body, or chunks), and the view."""
