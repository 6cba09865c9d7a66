"""The LLM side: an encoder-decoder (T5Gemma) served on a paged KV cache, for prompt enhancement and
batched text generation. It imports kernels/ and loading/ below it; nothing diffusion-side imports it
except the faces (cli) that offer prompt enhancement.

Floor (what every part below uses):
  forward_batch      ForwardMode and ForwardBatch: one step's mode and batch layout
  attention_layer    the per-layer attention parameters a layer hands to its backend
  memory             request rows (req_to_token), the page allocator, per-layer K/V buffers
Middle:
  backends/          torch_native, flash_attention (FA3/FA4), flashinfer: metadata once per step
  models/            the T5Gemma encoder-decoder and its HF-checkpoint loader
Top:
  model_runner, scheduler, sampling, engine   continuous batching over the KV cache
  cuda_graph_runner  decode steps replayed from CUDA graphs per batch-size bucket
  speculative        greedy speculative decoding with a draft model
  enhancer, cli      PromptEnhancer and the `enhance` subcommand
"""
