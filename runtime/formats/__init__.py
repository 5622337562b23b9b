"""Formats and cost: router traces on disk (trace: Arrow/NPZ, synthetic generators) and the host cost
model that turns a replay's counters into time per token (costmodel, with the host presets in
runtime/data/hosts).
"""
