"""Logit bias and penalties from state kept per request, built once and grown by each new token.

A request's logit bias and the distinct token ids of its prompt are the same for its n sequences
and for every step: they become tensors once, when the request first samples, shared by its
sequences. Each sequence then adds the tokens it samples to its own row of that state: the
distinct ids it generated that its prompt lacks (repetition penalty), and its distinct output ids
with their counts (frequency and presence penalties). A step's Python work is a few tensor
operations per request and a set lookup per new token, instead of a walk over every sequence's
prompt, outputs and bias entries (50-80 ms a step at n=128 with a 1,024-entry bias).

The results are bit-identical to engine.sampler's list-based `apply_logit_bias` and
`apply_penalties` (the reference the tests hold this to): the same logits get the same float32
operations, and padding repeats one of the row's own entries, so that a scatter writes it twice
with one value.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from typing import Any

import torch

_MIN_CAPACITY = 16  # columns a row buffer starts with; it doubles when full


class RequestSamplingState:
    """One request's bias and penalty state: shared tensors, and one row per sequence index."""

    def __init__(self, params: Any, prompt: list[int], num_rows: int, vocab_size: int, device: torch.device):
        self.params = params
        self.prompt = prompt  # to check that a sibling found by request id has this prompt
        self.vocab_size = vocab_size
        self.device = device
        bias = [(t, b) for t, b in (params.logit_bias or {}).items() if t < vocab_size]
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if bias:
            self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
            self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
        self.repetition = params.repetition_penalty != 1.0
        self.frequency = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self.num_rows = 0
        self.owner: list[int | None] = []  # seq_id holding each row
        self.num_absorbed: list[int] = []  # outputs of each row taken in so far
        self.extra_sets: list[set[int]] = []  # per row: generated ids not in the prompt
        self.out_pos: list[dict[int, int]] = []  # per row: output id -> its column
        self._writes: dict[str, tuple[list[int], list[int], list[int]]] = {
            "extra": ([], [], []),
            "out": ([], [], []),
            "count": ([], [], []),
        }
        if self.repetition:
            assert prompt, "a sequence's prompt has at least one token"
            distinct = list(dict.fromkeys(prompt))
            self.prompt_set = frozenset(distinct)
            self.prompt_ids = torch.tensor(distinct, dtype=torch.long, device=device)  # (num_distinct,)
            self.extra_ids = torch.zeros(0, _MIN_CAPACITY, dtype=torch.long, device=device)
        if self.frequency:
            self.out_ids = torch.zeros(0, _MIN_CAPACITY, dtype=torch.long, device=device)
            self.out_counts = torch.zeros(0, _MIN_CAPACITY, dtype=torch.float32, device=device)
        self._add_rows(num_rows)

    def matches(self, params: Any, prompt: list[int], vocab_size: int, device: torch.device) -> bool:
        return (
            self.params is params
            and self.vocab_size == vocab_size
            and self.device == device
            and self.prompt == prompt
        )

    # -- rows ------------------------------------------------------------------------------------

    def _add_rows(self, num_rows: int) -> None:
        extra = num_rows - self.num_rows
        if extra <= 0:
            return
        self.num_rows = num_rows
        self.owner += [None] * extra
        self.num_absorbed += [0] * extra
        self.extra_sets += [set() for _ in range(extra)]
        self.out_pos += [{} for _ in range(extra)]
        if self.repetition:
            self.extra_ids = _grow(self.extra_ids, rows=num_rows)
        if self.frequency:
            self.out_ids = _grow(self.out_ids, rows=num_rows)
            self.out_counts = _grow(self.out_counts, rows=num_rows)

    def _reset_row(self, row: int) -> None:
        self.num_absorbed[row] = 0
        self.extra_sets[row] = set()
        self.out_pos[row] = {}
        if self.frequency:
            self.out_ids[row].zero_()
            self.out_counts[row].zero_()

    def absorb(self, seq_id: int, row: int, outputs: Seq[int]) -> None:
        """Take in the outputs of sequence `seq_id` (at `row`) produced since the last call."""
        self._add_rows(row + 1)
        done = self.num_absorbed[row]
        if self.owner[row] != seq_id or len(outputs) < done:
            self._reset_row(row)  # another sequence with this index, or outputs taken back
            self.owner[row], done = seq_id, 0
        if len(outputs) == done:
            return
        if self.repetition:
            seen, rows, cols, vals = self.extra_sets[row], *self._writes["extra"]
            for token in outputs[done:]:
                if token not in self.prompt_set and token not in seen:
                    rows.append(row)
                    cols.append(len(seen))
                    vals.append(token)
                    seen.add(token)
        if self.frequency:
            pos, rows, cols, vals = self.out_pos[row], *self._writes["out"]
            count_rows, count_cols, _ = self._writes["count"]
            for token in outputs[done:]:
                col = pos.get(token)
                if col is None:
                    col = pos[token] = len(pos)
                    rows.append(row)
                    cols.append(col)
                    vals.append(token)
                count_rows.append(row)
                count_cols.append(col)
        self.num_absorbed[row] = len(outputs)

    def flush(self) -> None:
        """Write the absorbed tokens into the row buffers: a few tensor operations per request."""
        rows, cols, vals = self._writes["extra"]
        if rows:
            self.extra_ids = _grow(self.extra_ids, cols=max(cols) + 1)
            self.extra_ids[self._t(rows), self._t(cols)] = self._t(vals)
        rows, cols, vals = self._writes["out"]
        if rows:
            self.out_ids = _grow(self.out_ids, cols=max(cols) + 1)
            self.out_counts = _grow(self.out_counts, cols=self.out_ids.shape[1])
            self.out_ids[self._t(rows), self._t(cols)] = self._t(vals)
        rows, cols, _ = self._writes["count"]
        if rows:
            ones = torch.ones(len(rows), dtype=torch.float32, device=self.device)
            self.out_counts.index_put_((self._t(rows), self._t(cols)), ones, accumulate=True)
        for lists in self._writes.values():
            for values in lists:
                values.clear()

    def _t(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    # -- per-step blocks -------------------------------------------------------------------------

    def prompt_block(self, num_rows: int) -> torch.Tensor:
        """(num_rows, num_distinct) the prompt's distinct ids, a view: no copy per step."""
        return self.prompt_ids.unsqueeze(0).expand(num_rows, self.prompt_ids.shape[0])

    def extra_block(self, rows: list[int]) -> tuple[torch.Tensor, list[bool]] | None:
        """(len(rows), width) the ids each row generated that its prompt lacks, padded with the
        row's first such id, and which rows have any (a row without one has zeros); None when no
        row has any. Disjoint from the prompt's ids, so each seen id is penalized exactly once."""
        lens = [len(self.extra_sets[r]) for r in rows]
        width = max(lens)
        if width == 0:
            return None
        ids = self.extra_ids[self._t(rows), :width]
        if width > 1:
            keep = torch.arange(width, device=self.device).unsqueeze(0) < self._t(lens).unsqueeze(1)
            ids = torch.where(keep, ids, ids[:, :1])
        return ids, [n > 0 for n in lens]

    def output_block(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, counts), each (len(rows), width): each row's distinct output ids and how often it
        generated them, padded with its first entry (id 0 with count 0 for a row without outputs)."""
        width = max(1, max(len(self.out_pos[r]) for r in rows))
        idx = self._t(rows)
        ids, counts = self.out_ids[idx, :width], self.out_counts[idx, :width]
        if width > 1:
            lens = self._t([len(self.out_pos[r]) for r in rows]).unsqueeze(1)
            keep = torch.arange(width, device=self.device).unsqueeze(0) < lens
            ids = torch.where(keep, ids, ids[:, :1])
            counts = torch.where(keep, counts, counts[:, :1])
        return ids, counts


def _grow(buffer: torch.Tensor, *, rows: int = 0, cols: int = 0) -> torch.Tensor:
    """`buffer` with at least `rows` rows and `cols` columns (columns double), zero-filled."""
    num_rows, num_cols = buffer.shape
    new_cols = num_cols
    while new_cols < cols:
        new_cols *= 2
    if rows <= num_rows and new_cols == num_cols:
        return buffer
    grown = buffer.new_zeros(max(rows, num_rows), new_cols)
    grown[:num_rows, :num_cols] = buffer
    return grown


class SamplingStates:
    """Finds (or builds) each sequence's request state: kept on the sequence, and shared by its
    siblings through a weak map by request id, so it lives exactly as long as they do."""

    def __init__(self) -> None:
        self._by_request: weakref.WeakValueDictionary[str, RequestSamplingState] = (
            weakref.WeakValueDictionary()
        )

    def rows(
        self, seqs: Seq[Any], vocab_size: int, device: torch.device
    ) -> list[tuple[RequestSamplingState, int]]:
        """Each sequence's state, brought up to date with its outputs, and its row in it."""
        out: list[tuple[RequestSamplingState, int]] = []
        touched: dict[int, RequestSamplingState] = {}
        for seq in seqs:
            state = seq.sampling_state
            # A sequence's params and prompt never change: only _find compares them, once.
            if state is None or state.vocab_size != vocab_size or state.device != device:
                state = self._find(seq, vocab_size, device)
                seq.sampling_state = state
            state.absorb(seq.seq_id, seq.index, seq.output_token_ids)
            touched[id(state)] = state
            out.append((state, seq.index))
        for state in touched.values():
            state.flush()
        return out

    def _find(self, seq: Any, vocab_size: int, device: torch.device) -> RequestSamplingState:
        params, prompt = seq.sampling_params, seq.prompt_token_ids
        state = self._by_request.get(seq.request_id)
        if state is None or not state.matches(params, prompt, vocab_size, device):
            num_rows = max(getattr(params, "n", 1), seq.index + 1)
            state = RequestSamplingState(params, prompt, num_rows, vocab_size, device)
            self._by_request[seq.request_id] = state
        return state


def apply_bias_and_penalties(
    logits: torch.Tensor, params: Seq[Any], rows: Seq[tuple[RequestSamplingState, int]]
) -> None:
    """logit_bias, then the repetition, frequency and presence penalties, in place, from the
    states of `rows` (one per logits row, as SamplingStates.rows returns them)."""
    device = logits.device
    groups: dict[int, tuple[RequestSamplingState, list[int], list[int]]] = {}
    for i, (state, row) in enumerate(rows):
        group = groups.setdefault(id(state), (state, [], []))
        group[1].append(i)
        group[2].append(row)
    batch_rows = {key: torch.tensor(g[1], dtype=torch.long, device=device) for key, g in groups.items()}

    for key, (state, rows_in_batch, _) in groups.items():
        if state.bias_ids is None or state.bias_values is None:
            continue
        if len(rows_in_batch) == logits.shape[0]:  # one request fills the batch: one fast kernel
            shape = (len(rows_in_batch), state.bias_ids.shape[0])
            logits.scatter_add_(1, state.bias_ids.expand(shape), state.bias_values.expand(shape))
        else:
            logits[batch_rows[key].unsqueeze(1), state.bias_ids.unsqueeze(0)] += state.bias_values

    num_seqs = logits.shape[0]
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        # Two passes over disjoint ids (the prompt's, then those generated beyond it), so that the
        # prompt's part is a view shared by the request's rows, never copied or rebuilt per step.
        prompt_blocks, extra_blocks = [], []
        rep_extra = [1.0] * num_seqs  # a row without generated extras: id 0 with a penalty of 1
        for key, (state, rows_in_batch, state_rows) in groups.items():
            if not state.repetition:
                continue
            prompt_blocks.append((batch_rows[key], state.prompt_block(len(state_rows))))
            extra = state.extra_block(state_rows)
            if extra is not None:
                extra_blocks.append((batch_rows[key], extra[0]))
                for i, has in zip(rows_in_batch, extra[1], strict=True):
                    if has:
                        rep_extra[i] = rep[i]
        _repetition(logits, _assemble(num_seqs, prompt_blocks, device), rep)
        if extra_blocks:
            _repetition(logits, _assemble(num_seqs, extra_blocks, device), rep_extra)

    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    if any(f != 0.0 or q != 0.0 for f, q in zip(freq, pres, strict=True)):
        id_blocks, count_blocks = [], []
        for key, (state, _, state_rows) in groups.items():
            if state.frequency:
                block_ids, block_counts = state.output_block(state_rows)
                id_blocks.append((batch_rows[key], block_ids))
                count_blocks.append((batch_rows[key], block_counts))
        ids = _assemble(num_seqs, id_blocks, device)
        counts = _assemble(num_seqs, count_blocks, device, dtype=torch.float32)
        f_t = torch.tensor(freq, dtype=torch.float32, device=device).unsqueeze(1)
        p_t = torch.tensor(pres, dtype=torch.float32, device=device).unsqueeze(1)
        values = logits.gather(1, ids)
        logits.scatter_(1, ids, values - f_t * counts - p_t * (counts > 0).to(torch.float32))


def _repetition(logits: torch.Tensor, ids: torch.Tensor, rep: list[float]) -> None:
    # As in the reference: a penalty below float32's smallest normal must not become 0 (a grammar's
    # masked -inf times 0 is nan).
    penalty = torch.tensor(rep, dtype=torch.float32, device=logits.device)
    penalty = penalty.clamp_(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    values = logits.gather(1, ids)  # (num_seqs, width)
    logits.scatter_(1, ids, torch.where(values > 0, values / penalty, values * penalty))


def _assemble(
    num_seqs: int,
    blocks: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """(num_seqs, width) from per-request blocks placed at their batch rows; a block narrower than
    the widest is padded with its own first column, rows of no block are zeros (id 0, count 0:
    a penalty of 1 or 0 there changes nothing, as in the reference)."""
    if len(blocks) == 1 and blocks[0][1].shape[0] == num_seqs:
        return blocks[0][1]  # one request fills the batch: its rows are 0..num_seqs-1 in order
    width = max(block.shape[1] for _, block in blocks)
    out = torch.zeros(num_seqs, width, dtype=dtype, device=device)
    for rows, block in blocks:
        if block.shape[1] < width:
            pad = block[:, :1].expand(block.shape[0], width - block.shape[1])
            block = torch.cat([block, pad], dim=1)
        out[rows] = block
    return out
