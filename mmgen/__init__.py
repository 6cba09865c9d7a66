"""mmgen: a diffusion-model runtime whose attention metadata is passed explicitly."""

__version__ = "0.1.0"
