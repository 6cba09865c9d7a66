"""Noise schedules and samplers mmgen computes itself (diffusers' arithmetic, without its import)."""
