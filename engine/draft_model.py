"""Drafts from a smaller model of the same vocabulary (speculative decoding with a draft model).

Where a deployment names a draft model (SpeculativeConfig.draft_model), the engine's speculator
asks it for each decoding sequence's draft instead of looking n-grams up: the draft model decodes
greedily from the sequence's tokens, k tokens, and the target model verifies them in its next step
exactly as it verifies n-gram drafts (engine.speculative). The output is the target's whatever the
draft: greedy rows keep the target's argmax, sampled rows the target's distribution.

The draft model keeps a paged KV cache of its own (its own runner and block manager, no prefix
caching). Each sequence has a shadow sequence there holding what the draft model has computed; on
the next call the shadow is cut back to the tokens the target accepted (the rejected drafts' KV
rolled back), and only the tokens since then are fed. A shadow is dropped when its sequence
finishes, and the least recently drafted ones make room when the draft pool is full.

Drafts are made one sequence at a time, k forwards each: worth it where the draft model costs a
small fraction of the target (a 0.5B draft for a 7B+ target), not for two models of a size.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.config import ConfigError
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


class DraftModel:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        num_blocks: int,
        block_size: int = 16,
    ) -> None:
        from engine.engine_setup import make_backend
        from engine.models import ModelLoadError, load_model, load_model_config

        try:
            config = load_model_config(model_dir)
        except ModelLoadError as exc:
            raise ConfigError(f"the draft model cannot be loaded: {exc}") from exc
        if config.vocab_size != vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary has {config.vocab_size} tokens, the model's {vocab_size}: "
                "a draft model must share the model's tokenizer"
            )
        self.model = load_model(
            model_dir,
            make_backend("auto", device),
            dtype=str(dtype).removeprefix("torch."),
            device=device,
            max_model_len=max_model_len,
        )
        self.max_model_len = max_model_len
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=max_model_len,
            sampler=Sampler([]),
        )
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        # seq_id -> (the sequence, its shadow), least recently drafted first.
        self._shadows: OrderedDict[int, tuple[Any, Sequence]] = OrderedDict()

    def propose(self, seq: Any, k: int) -> list[int]:
        """Up to k tokens the draft model decodes greedily after seq's tokens ([] when its pool
        cannot hold them even after making room)."""
        shadow = self._shadow(seq)
        draft: list[int] = []
        for _ in range(k):
            num_new = shadow.num_tokens - shadow.num_computed_tokens
            if not self._room(shadow, num_new):
                break
            self.blocks.allocate(shadow, num_new)
            out = self.runner.run(SchedulerOutput([ScheduledSequence(shadow, num_new)], num_new, [], []))
            shadow.num_computed_tokens += num_new
            token = out.sampled_token_ids[shadow.seq_id][0]
            shadow.append_token(token)
            draft.append(token)
        self.runner.free(shadow.seq_id)  # its per-sequence sampling state: a new shadow next time
        return draft

    def _shadow(self, seq: Any) -> Sequence:
        """seq's shadow, holding the KV of the longest prefix it shares with seq's tokens."""
        tokens = seq.token_ids
        held = self._shadows.pop(seq.seq_id, None)
        old = held[1] if held is not None else None
        shadow = Sequence(f"draft-{seq.seq_id}", tokens, _GREEDY)
        if old is not None:
            common = 0
            limit = min(old.num_computed_tokens, len(tokens))
            old_tokens = old.token_ids
            while common < limit and old_tokens[common] == tokens[common]:
                common += 1
            # The last token is always fed again: its logits give the first draft token.
            common = min(common, len(tokens) - 1)
            old.num_computed_tokens = common
            self.blocks.trim(old, common)
            shadow.block_table, shadow.num_computed_tokens = old.block_table, common
        self._shadows[seq.seq_id] = (seq, shadow)
        return shadow

    def _room(self, shadow: Sequence, num_new: int) -> bool:
        """Whether shadow can take num_new more tokens, dropping finished sequences' shadows, then
        the least recently drafted ones, until it can."""
        if self.blocks.can_allocate(shadow, num_new):
            return True
        for seq_id, (seq, other) in list(self._shadows.items()):
            if other is not shadow and seq.is_finished:
                self._drop(seq_id)
        for seq_id, (_, other) in list(self._shadows.items()):
            if self.blocks.can_allocate(shadow, num_new):
                break
            if other is not shadow:
                self._drop(seq_id)
        return self.blocks.can_allocate(shadow, num_new)

    def _drop(self, seq_id: int) -> None:
        _, shadow = self._shadows.pop(seq_id)
        self.blocks.free(shadow)

    def release_finished(self) -> None:
        """Free the shadows of sequences that have finished."""
        for seq_id, (seq, _) in list(self._shadows.items()):
            if seq.is_finished:
                self._drop(seq_id)

    @property
    def num_shadows(self) -> int:
        return len(self._shadows)
