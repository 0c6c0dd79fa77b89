"""Convert stage: the training checkpoint (ZeRO shards or a Lightning file) -> one verified fp32 safetensors, once."""

from tasks.convert.stage import ConvertSummary, convert

__all__ = ["ConvertSummary", "convert"]
