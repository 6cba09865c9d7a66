"""The LLM side's models: the T5Gemma encoder-decoder on the paged-KV runtime, and its loader."""
