"""The native forward of the embedded engine: packed weight formats (fp32, bf16, GGUF Q8_0 / Q4_1), a
Llama-family decoder stack in fused CPU kernels (PyTorch operations elsewhere), and a slot-based static KV cache
with the interface of :class:`~specadapt.engine.kv.RaggedKVCache` (docs/native_forward.md)."""

from .cache import MAX_TREE_NODES, SlotKVCache
from .formats import RUN_FORMATS, PackedWeight, WeightFormat, linear_reference, pack_weight
from .model import NativeLlama, NativeOutput, NativeUnsupported, TokenBatch, native_support

__all__ = [
    "MAX_TREE_NODES",
    "SlotKVCache",
    "RUN_FORMATS",
    "PackedWeight",
    "WeightFormat",
    "linear_reference",
    "pack_weight",
    "NativeLlama",
    "NativeOutput",
    "NativeUnsupported",
    "TokenBatch",
    "native_support",
]
