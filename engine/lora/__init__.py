"""Multi-LoRA serving: adapters read from PEFT directories, device slots, batched low-rank updates.

Modules: loader (PEFT directory -> host tensors), slots (which adapter holds which device slot),
layers (the batched update on the model's fused linears), manager (keys, host cache, per-step mapping).
"""
