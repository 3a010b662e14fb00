"""A reasoning model's thinking, read apart from its answer: `reasoning_content` beside `content`, as
vLLM's reasoning parsers return it, for a whole answer or streamed.

- ``qwen3``: the answer opens with ``<think>``, thinks, closes with ``</think>`` and answers. An
  answer that does not open with ``<think>`` (thinking turned off: the template closed the block in
  the prompt) is all content.
- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the answer thinks from its first
  token up to ``</think>`` (a ``<think>`` the model writes first anyway is dropped).

Either way an answer cut short before ``</think>`` is all reasoning, and the whitespace between
``</think>`` and the answer (the blank line the models write) is dropped. A whole answer is split
by streaming it (`split`), so the stream's reasoning pieces join to exactly the whole answer's
reasoning, and its content pieces to its content.

Standard library only: no Django, no torch.
"""

from __future__ import annotations

START, END = "<think>", "</think>"

# name -> label (the deployment setting's choices)
PARSERS = {
    "qwen3": "Qwen3 (<think>...</think> opens the answer)",
    "deepseek_r1": "DeepSeek-R1 (the prompt opens <think>)",
}

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept back until the next piece)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One streamed answer: text pieces in, (kind, text) pieces out, never an empty one."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(PARSERS)}")
        # opening: before the first non-blank text, which decides (qwen3: <think> or content;
        # deepseek_r1: a repeated <think> or reasoning); reasoning; after: between </think> and the
        # answer; content.
        self.parser = parser
        self.state = "opening"
        self.pending = ""
        self.reasoned = False  # the answer has a reasoning part (even an empty one)

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        out: list[Piece] = []
        while True:
            if self.state == "opening":
                stripped = self.pending.lstrip()
                if not stripped or (START.startswith(stripped) and stripped != START):
                    return out  # blank so far, or maybe the start of <think>
                self.reasoned = stripped.startswith(START) or self.parser == "deepseek_r1"
                if stripped.startswith(START):
                    self.pending = stripped[len(START) :]
                self.state = "reasoning" if self.reasoned else "content"
            elif self.state == "reasoning":
                end = self.pending.find(END)
                if end >= 0:
                    self._emit(out, "reasoning", self.pending[:end])
                    self.pending = self.pending[end + len(END) :]
                    self.state = "after"
                    continue
                keep = _held(self.pending, END)
                self._emit(out, "reasoning", self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return out
            elif self.state == "after":
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return out
                self.state = "content"
            else:
                self._emit(out, "content", self.pending)
                self.pending = ""
                return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.state == "opening" and self.parser == "deepseek_r1":
            self.reasoned = True
            self._emit(out, "reasoning", self.pending.lstrip())
        elif self.state in ("opening", "content"):
            self._emit(out, "content", self.pending)
        elif self.state == "reasoning":
            self._emit(out, "reasoning", self.pending)  # cut short: a partial </think> is text
        self.pending = ""
        return out

    @staticmethod
    def _emit(out: list[Piece], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: reasoning None when the answer has no reasoning
    part, content None when nothing follows it."""
    stream = ReasoningStream(parser)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.reasoned else None), (content or None)
