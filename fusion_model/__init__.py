"""Multimodal fusion classifier (timm image encoder + tabular + text, fused by an MLP).

A library: it knows nothing of Prefect or DVC. Heavy imports (torch, lightning, deepspeed) live in the
submodules so importing the package is cheap.
"""
