"""The step-level engine: requests in, one scheduled forward per step(), per-request deltas out.

This is what the offline LLM and the Redis worker drive. Everything about a request that arrives from
outside is checked in add_request and refused with a typed error before any state changes.
"""

from __future__ import annotations

import logging
import threading

import torch

from engine import request_intake
from engine.config import EngineConfig
from engine.engine_setup import EngineSetup, build_engine_setup
from engine.grammar_waits import GrammarWaits
from engine.lora.manager import LoRAManager
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.protocol import FinishReason
from engine.request_state import (
    Completion,
    EngineLoad,
    EngineRequest,
)
from engine.scheduler import FINISH_QUEUE_TIMEOUT, Scheduler
from engine.sequence import Sequence
from engine.speculative import Speculator
from engine.step_interrupt import StepInterrupted, checker, interruptible
from engine.step_profile import StepProfile
from engine.structured_output.manager import GrammarRequests
from engine.warm_up import shared_step_costs, warm_up

# The step costs past the fixed and prompt-token rows, named alike in the scheduler config, the
# measured costs (engine.warm_up) and the step width.
EXTRA_STEP_COSTS = ("decode_key_rows", "prompt_key_rows", "prompt_logprob_rows")

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        setup: EngineSetup = build_engine_setup(config)
        self.tokenizer = setup.tokenizer
        self.model_config = setup.model_config
        self.max_model_len = setup.max_model_len
        self.eos_token_ids = list(setup.model_config.eos_token_ids)
        self.device = setup.device
        self.lora_manager: LoRAManager | None = None
        if config.lora is not None:
            self.lora_manager = LoRAManager(config.lora, setup.model, self.model_config)
        lora_slots = self.lora_manager.slots if self.lora_manager is not None else None
        self.grammars = GrammarRequests(
            self.tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            config=config.structured_output,
        )
        self.speculator: Speculator | None = None
        if config.speculative is not None:
            draft_model = None
            if config.speculative.draft_model is not None:
                from engine.draft_model import DraftModel

                weight = setup.model.model.embed_tokens.weight
                draft_model = DraftModel(
                    config.speculative.draft_model,
                    vocab_size=setup.model_config.vocab_size,
                    device=weight.device,
                    dtype=weight.dtype,
                    max_model_len=self.max_model_len,
                    num_blocks=config.speculative.draft_num_blocks,
                    block_size=config.cache.block_size,
                )
            self.speculator = Speculator(config.speculative, self.max_model_len, draft_model)
            self.speculator.grammar_prefix = self.grammars.draft_prefix
        self.scheduler = Scheduler(
            setup.scheduler_config,
            config.cache,
            setup.num_blocks,
            lora_slots,
            self.speculator,
            window=setup.model_config.kv_window,
            num_window_blocks=setup.num_window_blocks,
        )
        self.runner = ModelRunner(
            setup.model,
            num_blocks=setup.num_blocks,
            num_window_blocks=setup.num_window_blocks,
            block_size=config.cache.block_size,
            max_model_len=self.max_model_len,
            sampler=setup.sampler,
            lora=self.lora_manager,
            grammar_bitmask=self.grammars.start_bitmask,
            enforce_eager=config.enforce_eager,
            cuda_graph_batch_sizes=setup.cuda_graph_batch_sizes,
        )
        self.warm_up_seconds = (
            warm_up(self.runner, setup.scheduler_config.max_num_batched_tokens, self.max_model_len)
            if config.warm_up
            else 0.0
        )
        sched_config = setup.scheduler_config
        cost_names = ("decode_fixed_rows", "prompt_token_rows", *EXTRA_STEP_COSTS)
        if (
            config.warm_up
            and sched_config.shared_step_slowdown > 0
            and any(getattr(sched_config, name) is None for name in cost_names)
        ):
            costs = shared_step_costs(self.runner, sched_config.max_num_seqs, self.max_model_len)
            width = self.scheduler.step_width
            if costs is not None:  # what the deployment set stands
                if sched_config.decode_fixed_rows is None:
                    width.fixed_rows = costs.fixed_rows
                if sched_config.prompt_token_rows is None:
                    width.prompt_token_rows = costs.prompt_token_rows
                for name in EXTRA_STEP_COSTS:
                    if getattr(sched_config, name) is None:
                        setattr(width, name, getattr(costs, name))
        self._requests: dict[str, EngineRequest] = {}
        self._completions: dict[int, Completion] = {}  # seq_id -> completion
        self.grammar_waits = GrammarWaits(self)
        self.output_processor = OutputProcessor(self)
        self._ended_at_add: dict[str, None] = {}  # resumed requests that had ended on the lost replica
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_resumed_requests = 0  # taken over from lost replicas (engine.resume)
        self.num_resumed_tokens = 0
        # Per-phase step timings when set (the engine benchmarks do); None costs nothing.
        self.profile: StepProfile | None = None
        # Set by the replica's worker when a request more important than the spare-capacity tier
        # arrives (engine.step_interrupt): a step of that tier alone is then given up between
        # layers. None: steps are never given up.
        self.arrived: threading.Event | None = None
        self.num_interrupted_steps = 0

    def enable_step_interrupts(self) -> threading.Event:
        """The event the replica's worker sets when a more important request arrives: from now on
        a step of spare-capacity sequences alone is given up then (engine.step_interrupt), and
        such steps no longer stay narrow for a lingering tenant (engine.step_width)."""
        self.arrived = threading.Event()
        self.scheduler.step_width.spare_steps_interruptible = True
        return self.arrived

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # -- requests -------------------------------------------------------------------------------

    add_request = request_intake.add_request

    def abort_request(self, request_id: str) -> None:
        """Takes effect at the next step(), which frees the blocks and reports the request finished."""
        if self.grammar_waits.abort(request_id):
            return
        self.scheduler.abort(request_id)

    def request(self, request_id: str) -> EngineRequest:
        """An unfinished request's state."""
        return self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def running_request_ids(self) -> set[str]:
        """Requests with a sequence in the running batch (read, never changed)."""
        return {seq.request_id for seq in self.scheduler.running}

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        profile = self.profile
        if profile is not None:
            profile.start()
        touched: dict[str, None] = self._ended_at_add
        self._ended_at_add = {}
        if self.grammars.waiting:
            touched.update(self.grammar_waits.step())
        sched_out = self.scheduler.schedule()
        if profile is not None:
            profile.mark("schedule")
        if not sched_out.scheduled and not touched and self.grammars.waiting:
            self.grammars.wait(0.05)  # nothing to run until a grammar is ready: do not spin
        for seq in sched_out.finished_aborted:
            self.finish_completion(seq, FinishReason.ABORT, None)
            touched[seq.request_id] = None
        for seq in sched_out.finished_expired:
            req = self._requests[seq.request_id]
            req.error = "the request waited in the queue past its deadline and was dropped before it started"
            req.error_code = FINISH_QUEUE_TIMEOUT
            self.finish_completion(seq, FinishReason.ERROR, None)
            touched[seq.request_id] = None
        if sched_out.scheduled:
            self.num_steps += 1
            arrived = self.arrived
            between = checker(arrived) if arrived is not None and interruptible(sched_out.scheduled) else None
            try:
                result = self.runner.run(sched_out, profile, between)
            except StepInterrupted:
                # Nothing of the step is kept; its sequences are scheduled again (the more
                # important prompt first).
                self.num_interrupted_steps += 1
                return self.output_processor.outputs(touched)
            except Exception as exc:  # a failed forward ends the requests in it, not the engine
                return self.output_processor.outputs(touched) + self.output_processor.fail(sched_out, exc)
            for seq_id, entries in result.prompt_logprobs.items():
                self._completions[seq_id].seq.prompt_logprobs.extend(entries)
            for seq in self.scheduler.update_from_output(sched_out, result.sampled_token_ids):
                self.output_processor.append(
                    seq, result.sampled_token_ids[seq.seq_id], result.logprobs[seq.seq_id]
                )
                touched[seq.request_id] = None
            if profile is not None:
                profile.mark("detokenize")
                profile.num_steps += 1
                profile.num_tokens += sched_out.num_batched_tokens
        outputs = self.output_processor.outputs(touched)
        if profile is not None:
            profile.mark("output")
        return outputs

    def finish_completion(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        self.output_processor.finish(seq, reason, stop_reason)

    # -- introspection --------------------------------------------------------------------------

    def load(self) -> EngineLoad:
        sched, blocks = self.scheduler, self.scheduler.block_manager
        return EngineLoad(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            kv_cache_usage=blocks.usage,
            prefix_cache_hit_rate=blocks.prefix_cache_stats()["hit_rate"],
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_total_blocks,
            loras_loaded=self.lora_manager.loaded_names() if self.lora_manager is not None else [],
            num_resumed_requests=self.num_resumed_requests,
            num_resumed_tokens=self.num_resumed_tokens,
            spec_num_draft_tokens=self.speculator.stats.num_draft_tokens if self.speculator else 0,
            spec_num_accepted_tokens=self.speculator.stats.num_accepted_tokens if self.speculator else 0,
            num_interrupted_steps=self.num_interrupted_steps,
        )

    def get_stats(self) -> dict[str, int | float | list[str]]:
        stats: dict[str, int | float | list[str]] = dict(self.scheduler.get_stats())
        stats.update(
            num_requests=len(self._requests),
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            block_size=self.config.cache.block_size,
        )
        if self.lora_manager is not None:
            stats.update(self.lora_manager.get_stats())
        if self.speculator is not None:
            stats.update(self.speculator.stats.as_dict())
        if self.device.type == "cuda":
            stats["gpu_memory_allocated"] = torch.cuda.memory_allocated(self.device)
        return stats
