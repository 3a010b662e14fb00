"""Structured outputs: grammars (JSON schema, regex, choice, EBNF) that constrain what a request may
generate, enforced by a token bitmask per constrained sequence in the sampler (xgrammar).

`spec` checks the request's `structured_outputs` (standard library only); `grammar` builds the
tokenizer-free grammar, which the web tier uses to refuse a bad schema before anything is queued;
`manager` compiles grammars for the engine's tokenizer off the step loop, caches them and keeps a
matcher per constrained sequence.
"""
