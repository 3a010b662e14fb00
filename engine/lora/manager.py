"""Adapters by key, a host cache of loaded adapters, and the device slots the forward reads.

An adapter is keyed by (tenant, name, version): two tenants' adapters of one name never meet, and a
re-upload (a new version) gets a new lora_id, so prefix-cache blocks computed under the old weights
are never reused. It is read from disk on first use, while the request is added (between steps),
and kept in the host cache; adapters with unfinished sequences are never dropped from it, others
least-recently-used once more than max_cpu_loras are held. Which adapter holds which device slot is
decided by the scheduler through LoRASlots; begin_step copies newly assigned adapters into their
slots and maps the step's tokens to slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from engine.config import LoRAConfig
from engine.lora.layers import LoRAContext, LoRALinear, LoRAStep
from engine.lora.loader import FUSED_TARGETS, LoRAAdapter, load_adapter, module_dims
from engine.lora.slots import LoRASlots
from engine.models.config import ModelConfig

if TYPE_CHECKING:
    from engine.scheduler_output import ScheduledSequence

AdapterKey = tuple[str, str, str]  # (tenant, name, version)


def wrap_linears(
    model: Any, cfg: ModelConfig, config: LoRAConfig, context: LoRAContext, *, use_kernels: bool
) -> list[dict[str, LoRALinear]]:
    """Replace each decoder layer's fused linears by LoRALinear wrappers of them (again: rewrap)."""
    dims = module_dims(cfg)
    wrapped: list[dict[str, LoRALinear]] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        owners = {"qkv_proj": attn, "o_proj": attn, "gate_up_proj": mlp, "down_proj": mlp}
        per_layer: dict[str, LoRALinear] = {}
        for fused, subs in FUSED_TARGETS.items():
            if not hasattr(owners[fused], fused):  # a mixture of experts in place of the MLP
                continue
            base = getattr(owners[fused], fused)
            if isinstance(base, LoRALinear):
                base = base.base
            lora = LoRALinear(
                base,
                tuple(dims[s][1] for s in subs),
                context,
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                use_kernels=use_kernels,
            )
            setattr(owners[fused], fused, lora)
            per_layer[fused] = lora
        wrapped.append(per_layer)
    return wrapped


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        model: Any,  # a causal LM of engine.models (model.model.layers, embed_tokens)
        model_config: ModelConfig,
        *,
        use_kernels: bool | None = None,
    ) -> None:
        weight = model.model.embed_tokens.weight
        self.config = config
        self.model_config = model_config
        self.device, self.dtype = weight.device, weight.dtype
        # Triton kernels on CUDA; tests also run them on CPU under TRITON_INTERPRET=1.
        self.use_kernels = self.device.type == "cuda" if use_kernels is None else use_kernels
        self.slots = LoRASlots(config.max_loras)
        self.context = LoRAContext()
        self._model = model
        self.layers = wrap_linears(model, model_config, config, self.context, use_kernels=self.use_kernels)
        self._ids: dict[AdapterKey, int] = {}
        self._keys: dict[int, AdapterKey] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._refs: Counter[int] = Counter()  # unfinished sequences per adapter
        self._resident: list[int | None] = [None] * config.max_loras  # what each device slot holds now
        self.num_disk_loads = 0

    def set_kernels(self, enabled: bool) -> None:
        """Switch between the Triton kernels and the torch path before any adapter is resident;
        tests run the kernels on CPU under TRITON_INTERPRET=1 this way."""
        assert all(lora_id is None for lora_id in self._resident), "switch before the first adapter is served"
        self.use_kernels = enabled
        self.layers = wrap_linears(
            self._model, self.model_config, self.config, self.context, use_kernels=enabled
        )

    # -- adapters in and out ---------------------------------------------------------------------

    def add_adapter(self, key: AdapterKey, path: str, *, num_seqs: int = 1) -> int:
        """The lora_id of ``key``, reading the adapter from ``path`` unless the host cache has it.

        Pins it for ``num_seqs`` sequences until each is released. Raises LoRALoadError, with
        nothing changed, when the directory cannot be served.
        """
        lora_id = self._ids.get(key)
        if lora_id is None or lora_id not in self._host:
            adapter = load_adapter(
                path, self.model_config, max_rank=self.config.max_lora_rank, dtype=self.dtype
            )
            self.num_disk_loads += 1
            if lora_id is None:
                lora_id = len(self._ids) + 1  # never reused: prefix-cache keys stay unambiguous
                self._ids[key], self._keys[lora_id] = lora_id, key
            self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        self._refs[lora_id] += num_seqs
        self._shrink_host_cache()
        return lora_id

    def release(self, lora_id: int, num_seqs: int = 1) -> None:
        """A sequence of this adapter has finished."""
        self._refs[lora_id] -= num_seqs
        assert self._refs[lora_id] >= 0, f"lora {lora_id} released more often than added"
        if not self._refs[lora_id]:
            del self._refs[lora_id]
            self._shrink_host_cache()

    def _shrink_host_cache(self) -> None:
        idle = [i for i in self._host if not self._refs[i]]  # least recently used first
        for lora_id in idle[: max(0, len(self._host) - self.config.max_cpu_loras)]:
            del self._host[lora_id]
            self.slots.forget(lora_id)  # its weights can no longer be copied into a slot

    # -- per step --------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """True while the current step has tokens of some adapter."""
        return self.context.step is not None

    def begin_step(self, scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """Load newly assigned slots, map this step's tokens to slots, and return the scheduled
        sequences grouped by adapter (base model first), the order the batch must be laid out in."""
        self._sync_slots()
        slot_of = {lora_id: i for i, lora_id in enumerate(self.slots.slots) if lora_id is not None}
        ordered = sorted(scheduled, key=lambda item: item.seq.lora_id)  # stable: the base keeps its order
        segments: list[tuple[int, int, int]] = []
        token_slots: list[int] = []
        for item in ordered:
            lora_id, n = item.seq.lora_id, item.num_new_tokens
            slot = -1
            if lora_id:
                assert lora_id in slot_of, (
                    f"sequence {item.seq.seq_id} was scheduled without a slot for lora {lora_id}"
                )
                slot = slot_of[lora_id]
                if segments and segments[-1][0] == slot:
                    segments[-1] = (slot, segments[-1][1], segments[-1][2] + n)
                else:
                    segments.append((slot, len(token_slots), len(token_slots) + n))
            token_slots.extend([slot] * n)
        if not segments:
            self.context.step = None
            return ordered
        for slot, _, _ in segments:
            self.slots.touch(slot)
        slots_tensor = torch.tensor(token_slots, dtype=torch.int32).to(self.device, non_blocking=True)
        step = LoRAStep(slots_tensor, segments=segments)
        if self.use_kernels:
            from kernels.lora_groups import lora_token_groups

            step.groups = lora_token_groups(step.token_slots, self.config.max_loras)
        self.context.step = step
        return ordered

    def _sync_slots(self) -> None:
        for slot, lora_id in enumerate(self.slots.slots):
            if self._resident[slot] == lora_id:
                continue
            if lora_id is None:
                for layer in self.layers:
                    for linear in layer.values():
                        linear.clear_slot(slot)
            else:
                self._load_slot(slot, self._host[lora_id])
            self._resident[slot] = lora_id

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for index, layer in enumerate(self.layers):
            for fused, linear in layer.items():
                pairs = [adapter.weights.get((index, sub)) for sub in FUSED_TARGETS[fused]]
                linear.set_slot(slot, pairs, adapter.rank)

    # -- introspection ---------------------------------------------------------------------------

    def loaded_names(self) -> list[str]:
        """The adapters in device slots, as tenant/name."""
        names = []
        for lora_id in self.slots.slots:
            if lora_id is not None:
                tenant, name, _ = self._keys[lora_id]
                names.append(f"{tenant}/{name}")
        return names

    def get_stats(self) -> dict[str, int | list[str]]:
        return {
            "loras_loaded": self.loaded_names(),
            "num_loras_cached": len(self._host),
            "num_lora_slot_loads": self.slots.num_loads,
            "num_lora_slot_evictions": self.slots.num_evictions,
            "num_lora_disk_loads": self.num_disk_loads,
        }
