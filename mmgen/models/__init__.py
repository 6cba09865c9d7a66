"""The diffusion models and their text encoder (imports: attention, layers; never llm/ or loading/).

call        the DiT call contract every family's forward follows; DiTCall, the record its blocks read
wan         WanConfig and WanDiT, the Wan2.1 text-to-video DiT; attention metadata comes in as an argument
wan_blocks  its attention layer, transformer block and condition embedder
umt5        the UMT5 text encoder Wan conditions on

The LLM side's encoder-decoder (T5Gemma) lives in mmgen.llm.models: the LLM backends and diffusion
attention share only mmgen.kernels.
"""
