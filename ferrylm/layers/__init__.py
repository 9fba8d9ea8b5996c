"""Reusable building blocks: linear, norm, rotary, paged attention, MoE, sampler."""
