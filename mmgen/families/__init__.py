"""The family registry (see registry.py): a model family's detection, loader and capabilities, asked
by every face. A family outside this repository imports Family and Capabilities from here."""

from mmgen.families.family import Family, Loader
from mmgen.families.registry import (
    GROUP,
    detect,
    families,
    family_of,
    load_pipeline,
    makes_images,
    model_heads,
)
from pipelines.capabilities import Capabilities

__all__ = (
    "GROUP",
    "Capabilities",
    "Family",
    "Loader",
    "detect",
    "families",
    "family_of",
    "load_pipeline",
    "makes_images",
    "model_heads",
)
