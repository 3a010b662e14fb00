"""Failover: a request taken over from a replica that was lost while it streamed.

Its output stream is the record of what its client has (or is about to have): per index, the token
ids of every delta. The replica that takes the request over continues it from there, as one
request whose outputs are already partly there: the prompt and those tokens are computed again (a
prefix-cache hit where the blocks are still cached), and sampling goes on from the next token with
the same parameters. Everything that depends on the outputs so far is rebuilt from the tokens
themselves, by replaying them through the same code that produced them: the detokenizer and stop
checker (so a stop string that was held back at the boundary is still found), the grammar's matcher,
the penalties and min_tokens (which count outputs), and max_tokens (what is left of it). A sibling
of an `n` > 1 request whose replay ends it was finished already: it is not run again.

Deterministic parts stay the same: a greedy request continues with the text an undisturbed run
would have produced. A seeded one continues with a seed derived from its own and from how far it
got, so the same failover at the same point always gives the same text, but not the text of an
undisturbed run. Prompt logprobs, sent with the first output token, are not sent again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.protocol import Event
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.request_state import Completion


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """What a request had streamed when its replica was lost."""

    outputs: tuple[tuple[int, ...], ...]  # per index: the output token ids already streamed
    prompt_logprobs_sent: bool = False
    failovers: int = 1  # takeovers of this request so far, this one included

    @classmethod
    def from_events(cls, events: Iterable[Event], n: int) -> Resume | None:
        """The resume point an output stream shows; None when nothing was streamed yet (the request
        simply runs from its start)."""
        outputs: list[list[int]] = [[] for _ in range(n)]
        streamed = prompt_logprobs = False
        failovers = 0
        for event in events:
            if event.type == "failover":
                failovers += 1
            elif event.type == "delta":
                streamed = True
                prompt_logprobs = prompt_logprobs or event.prompt_logprobs is not None
                for out in event.outputs:
                    index = out.get("index")
                    if not isinstance(index, int) or not 0 <= index < n:
                        raise InvalidRequestError(f"the output stream names index {index!r} of {n}")
                    outputs[index].extend(out.get("token_ids") or ())
        if not streamed:
            return None
        return cls(tuple(tuple(o) for o in outputs), prompt_logprobs, max(1, failovers))

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters the continuation samples with."""
        if len(self.outputs) != params.n:
            raise InvalidRequestError(f"a resume of {len(self.outputs)} outputs for n={params.n}")
        changes: dict[str, Any] = {}
        if params.seed is not None:
            changes["seed"] = derived_seed(params.seed, self.num_tokens)
        if self.prompt_logprobs_sent and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None
        return dataclasses.replace(params, **changes) if changes else params


def derived_seed(seed: int, num_tokens: int) -> int:
    """The seed a seeded request continues with after `num_tokens` outputs (a signed 64-bit int)."""
    digest = hashlib.blake2b(f"pagoda-resume:{seed}:{num_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def replay(completion: Completion, tokens: Iterable[int], max_model_len: int) -> None:
    """Bring a new completion to where the lost replica's was: its sequence holds `tokens` as
    outputs, its output stream has seen them (the text they made was streamed already), and it is
    finished when one of them ended it."""
    seq, stream = completion.seq, completion.stream
    for token in tokens:
        if completion.finish_reason is not None:
            raise InvalidRequestError(f"index {seq.index} streamed tokens after its end")
        seq.append_token(token)
        step = stream.append_token(token, max_model_len_reached=seq.num_tokens >= max_model_len)
        completion.text += step.text
        if step.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = step.finish_reason, step.stop_reason
