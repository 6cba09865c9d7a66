"""What the family registry knows of Qwen-Image-2.1 before one loads: its directories' model_index.json
`_class_name` and its capabilities, apart from the pipeline (qwen_image21_family.py, imported when a
2.1 directory loads)."""

from __future__ import annotations

from pipelines.capabilities import Capabilities

PIPELINE_CLASS = "QwenImage21Pipeline"  # model_index.json's _class_name
# several condition images (image= a list), the prefix K/V cache a request may turn off (no_prefix_cache),
# the condition images' area a request may set (output_resolution); Ulysses and CFG parallel (parallel)
FEATURES = frozenset({"several_images", "prefix_cache", "output_resolution", "parallel"})
CAPABILITIES = Capabilities("image", ("t2i", "edit"), FEATURES)
