"""Batched token sampling with vLLM's processing order.

logits → grammar bitmask (constrained rows) → [raw logprobs] → logit_bias → penalties (repetition
over prompt+output, presence/frequency over output) → min_tokens (stop ids masked, except in
constrained rows: there the grammar says when the output may end) → greedy rows: argmax; random
rows: temperature → top_k → top_p → min_p → inverse-CDF draw.

Each random row takes one uniform number. Seeded rows draw it from their own torch.Generator and
nothing else, so a seeded request's tokens depend only on its seed and its own logits, not on
which other requests share the batch (every step is row-wise; no batch-wide reduction).

Logprobs are of the raw model distribution, log_softmax of the logits as they came from the model
(vLLM's default `raw_logprobs`), so they do not depend on temperature or truncation. The rank of
the sampled token is 1 + the number of tokens with a strictly higher logprob.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams
from engine.sampling_state import SamplingStates, apply_bias_and_penalties

if TYPE_CHECKING:
    from engine.sequence import Sequence as EngineSequence


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the raw distribution
    top_logprobs: list[tuple[int, float]]  # params.logprobs entries, most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request asked for none


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """One generator per seeded sequence; None means 'draw from the shared randomness'."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any Python int maps into torch's range
    return generator


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.states = SamplingStates()

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        token_bitmask: torch.Tensor | None = None,
        seqs: Sequence[EngineSequence] | None = None,
    ) -> SamplerOutput:
        """`token_bitmask`: (num_seqs, ceil(vocab_size / 32)) int32 of the tokens each row may
        sample (bit j of word w allows token 32 * w + j); a row with every bit set is free.

        `seqs`: the engine's sequences of the rows (their params, prompts and outputs are the other
        arguments). With them, logit bias and penalties come from per-request state kept on the
        sequences (engine.sampling_state), so a step's work no longer grows with the prompt and the
        bias of every row; without them, from the lists, as the reference."""
        num_seqs, vocab_size = logits.shape
        assert len(params) == len(prompt_token_ids) == len(output_token_ids) == num_seqs
        if generators is None:
            generators = [None] * num_seqs
        assert len(generators) == num_seqs
        eos = self.eos_token_ids if eos_token_ids is None else list(eos_token_ids)
        device = logits.device
        # float32 whatever the model dtype: bf16 softmax/cumsum loses the tail that top_p cuts.
        logits = logits.to(torch.float32, copy=True)
        constrained: list[int] = []
        if token_bitmask is not None:
            constrained = apply_token_bitmask(logits, token_bitmask)

        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if seqs is None:
            apply_logit_bias(logits, params)
            logits = apply_penalties(logits, params, prompt_token_ids, output_token_ids)
        else:
            assert len(seqs) == num_seqs
            apply_bias_and_penalties(logits, params, self.states.rows(seqs, vocab_size, device))
        _apply_min_tokens(logits, params, output_token_ids, eos, skip=constrained)

        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)
        elif len(random_rows) == num_seqs:
            token_ids = _inverse_cdf_sample(sampling_probs(logits, params), generators)
        else:
            # Greedy rows take the argmax of the penalized logits: exact, no randomness drawn.
            token_ids = logits.argmax(dim=-1)
            idx = torch.tensor(random_rows, device=device)
            probs = sampling_probs(logits[idx], [params[i] for i in random_rows])
            token_ids[idx] = _inverse_cdf_sample(probs, [generators[i] for i in random_rows])

        out_ids: list[int] = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * num_seqs
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, token_ids, params)
        return SamplerOutput(token_ids=out_ids, logprobs=logprobs)


def _padded_ids(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, keys), both (num_seqs, max_len). `ids` pads a row with a copy of its own last token,
    so a scatter of per-token values writes that token's value twice, never a wrong one (an empty
    row pads with 0 and must leave values unchanged). `keys` pads with a sentinel above every id,
    for counting occurrences without the padding."""
    width = max(1, max((len(r) for r in rows), default=0))
    keys = torch.full((len(rows), width), _SENTINEL, dtype=torch.long)
    fill = torch.zeros(len(rows), 1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            keys[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            fill[i, 0] = r[-1]
    keys = keys.to(device)
    ids = torch.where(keys == _SENTINEL, fill.to(device), keys)
    return ids, keys


_SENTINEL = 2**62


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """vLLM's penalties, in place: repetition divides positive logits (multiplies negative ones)
    of tokens seen in prompt or output; frequency subtracts per output occurrence; presence once.

    Sparse: only the seen tokens are gathered, changed and scattered back, instead of several
    passes over (num_seqs, vocab_size) that dominate the step on CPU. Built from the lists on every
    call: the engine's steps use engine.sampling_state, which must match this bit for bit.
    """
    device = logits.device
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        seen = [
            [*prompt, *out] if r != 1.0 else []
            for r, prompt, out in zip(rep, prompt_token_ids, output_token_ids, strict=True)
        ]
        ids, _ = _padded_ids(seen, device)
        # A penalty below float32's smallest normal (a positive 5e-324 passes every check) must not
        # become 0 here: a grammar's masked -inf times 0 is nan, and argmax picks nan.
        penalty = torch.tensor(rep, dtype=torch.float32, device=device)
        penalty = penalty.clamp_(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
        values = logits.gather(1, ids)  # (num_seqs, max_len)
        logits.scatter_(1, ids, torch.where(values > 0, values / penalty, values * penalty))
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(f != 0.0 or q != 0.0 for f, q in zip(freq, pres, strict=True)):
        outs = [
            out if f != 0.0 or q != 0.0 else []
            for f, q, out in zip(freq, pres, output_token_ids, strict=True)
        ]
        ids, keys = _padded_ids(outs, device)
        # Occurrences of each id in its row: the width of its run in the sorted row.
        sorted_keys = keys.sort(dim=1).values
        counts = torch.searchsorted(sorted_keys, ids, right=True) - torch.searchsorted(sorted_keys, ids)
        counts = counts.to(torch.float32)
        f_t = torch.tensor(freq, dtype=torch.float32, device=device).unsqueeze(1)
        p_t = torch.tensor(pres, dtype=torch.float32, device=device).unsqueeze(1)
        values = logits.gather(1, ids)
        logits.scatter_(1, ids, values - f_t * counts - p_t * (counts > 0).to(torch.float32))
    return logits


# Bits of each byte value, least significant first: a bitmask read as bytes unpacks with one gather
# (about twice as fast on CPU as shifting every int32 word 32 times).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> list[int]:
    """Set the logits of disallowed tokens to -inf, in place, in the rows that are constrained
    (not every bit set); returns those rows."""
    num_seqs, vocab_size = logits.shape
    assert bitmask.shape == (num_seqs, -(-vocab_size // 32)), (bitmask.shape, logits.shape)
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    rows = (bitmask != -1).any(dim=1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return []
    # Little-endian bytes of the words: byte k of word w holds tokens 32 * w + 8 * k .. + 7.
    words = bitmask[rows].view(torch.uint8).to(logits.device)  # (num_constrained, 4 * num_words)
    allowed = _BYTE_BITS.to(logits.device)[words.long()].view(rows.numel(), -1)[:, :vocab_size]
    if rows.numel() == num_seqs:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return rows.tolist()


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """OpenAI's logit_bias, in place, from the params (the reference of the per-request state)."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )


def _apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
    skip: Sequence[int] = (),
) -> None:
    """Until min_tokens outputs exist, tokens that would end the sequence cannot be sampled."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    skipped = set(skip)
    for i, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(out) >= p.min_tokens or i in skipped:
            continue
        # As vLLM: EOS only counts as a stop token when it is not ignored.
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        for t in stop_ids:
            if 0 <= t < vocab_size:
                rows.append(i)
                cols.append(t)
    if rows:
        logits[rows, cols] = float("-inf")


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p and min_p for non-greedy rows; returns probabilities."""
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits = logits / temp.unsqueeze(1)
    if any(p.top_k > 0 for p in params):
        logits = _apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _apply_top_p(logits, [p.top_p for p in params])
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask logits below the row's k-th largest value; ties with it are kept, as in vLLM."""
    vocab_size = logits.shape[1]
    k = [min(x, vocab_size) if x > 0 else vocab_size for x in top_k]
    max_k = max(x for x, on in zip(k, top_k, strict=True) if on > 0)
    # topk(max_k) instead of a full sort: the k-th value is the same whatever max_k is.
    values = logits.topk(max_k, dim=-1).values  # (num_seqs, max_k), descending
    pos = torch.tensor([min(x, max_k) - 1 for x in k], dtype=torch.long, device=logits.device)
    kth = values.gather(1, pos.unsqueeze(1))  # (num_seqs, 1)
    off = torch.tensor([x <= 0 for x in top_k], device=logits.device)
    kth = kth.masked_fill(off.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


# Rows whose top_p set lies within their best 256 tokens skip the full-vocabulary sort.
_TOP_P_CANDIDATES = 256


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the most likely tokens while the mass strictly above them is < p (the top token
    always stays): vLLM's rule of dropping the low tail whose cumulative mass is <= 1 - p."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    p = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)
    log_z = logits.logsumexp(dim=-1, keepdim=True)  # (num_seqs, 1)
    threshold, covered = _top_p_threshold(logits, log_z, p, min(vocab_size, _TOP_P_CANDIDATES))
    if not bool(covered.all()):
        # The set is wider than the candidates (a flat distribution): sort those rows in full.
        rows = (~covered).nonzero().squeeze(1)
        full, _ = _top_p_threshold(logits[rows], log_z[rows], p[rows], vocab_size)
        threshold[rows] = full
    threshold.masked_fill_(p >= 1.0, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p_threshold(
    logits: torch.Tensor, log_z: torch.Tensor, p: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    values = logits.topk(width, dim=-1).values  # (num_seqs, width), descending
    probs = (values - log_z).exp()
    mass_above = probs.cumsum(dim=-1) - probs
    num_kept = (mass_above < p).sum(dim=-1, keepdim=True)  # a prefix: mass_above only grows
    threshold = values.gather(1, (num_kept - 1).clamp(min=0))  # (num_seqs, 1) smallest kept value
    covered = (num_kept < width).squeeze(1) | (width == logits.shape[1])
    return threshold, covered


def _inverse_cdf_sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    # One uniform per row: a seeded row's draw comes from its own generator only, and costs one
    # number instead of a vocabulary's worth (an exponential race is ~10x slower on CPU).
    num_seqs = probs.shape[0]
    u = torch.empty(num_seqs, 1, dtype=torch.float32, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    cdf = probs.cumsum(dim=-1)  # (num_seqs, vocab_size)
    # Scale by the row total so float error in the sum cannot push u past the last bucket;
    # right=True never lands on a zero-probability token (its bucket is empty).
    target = u * cdf[:, -1:]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return token_ids.clamp_(max=probs.shape[1] - 1)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # (num_seqs, 1)
    ranks = (raw_logprobs > sampled).sum(dim=-1) + 1
    max_k = max(p.logprobs or 0 for p in params)
    top_vals: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if max_k > 0:
        vals, ids = raw_logprobs.topk(min(max_k, raw_logprobs.shape[1]), dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out: list[TokenLogprobs | None] = []
    for i, (p, tok, lp, rank) in enumerate(
        zip(params, token_ids.tolist(), sampled.squeeze(1).tolist(), ranks.tolist(), strict=True)
    ):
        if p.logprobs is None:
            out.append(None)
            continue
        top = list(zip(top_ids[i][: p.logprobs], top_vals[i][: p.logprobs], strict=True))
        out.append(TokenLogprobs(token_id=tok, logprob=lp, rank=rank, top_logprobs=top))
    return out
