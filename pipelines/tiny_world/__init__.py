"""The embedded default model's product tools: its trainer, its prompt-following evaluation, its contact sheet.

`python3 -m pipelines.tiny_world.train --out DIR` trains it, `python3 -m pipelines.tiny_world.evaluate`
scores prompt following on held-out prompts, `python3 -m pipelines.tiny_world.sheet --out PNG` draws
the sheet in docs/. The runtime side stays in mmgen: the synthetic world and its detector
(mmgen.tiny.world, mmgen.tiny.detector), the shipped weights (mmgen/tiny/weights) and the builder
of the model directory (mmgen.default_model).
"""
