"""Output identity and media writing: frames/latents sha256, atomic mp4/png/bytes writers, fsync.

Below both the pipelines and the faces (render, ab, generate, the default model): it imports neither,
only mmgen.errors, so every room that writes or names an output uses this one copy.
"""
