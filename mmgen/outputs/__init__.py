"""Output identity and media writing: frames/latents sha256, atomic mp4/png/bytes writers.

Below both the pipelines and the faces (render, ab, generate): it imports neither.
"""
