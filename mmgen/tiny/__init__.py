"""The tiny world the embedded default model was trained on: its scenes and captions (world) and the fixed
detector that reads a clip back (detector); the shipped weights live in weights/.

The trainer, the evaluation and the contact sheet are product tools: pipelines/tiny_world/.
"""
