"""Checkpoints from local disk into mmgen's diffusion models (imports: models; never llm/, render/ or pipelines/).

safetensors_dir  single-file or sharded safetensors, assigned to a module's parameters by name
diffusers_dir    a diffusers-format Wan text-to-video directory: configs, components, generation defaults
wan_transformer  the Wan DiT from diffusers-format or original-Wan-format keys
original_dir     an original-layout Wan2.2 A14B repository (expert folders, VAE and T5 .pth) as a whole
umt5             the UMT5 encoder from a transformers-format directory
tokenizer        the `tokenizers` tokenizer of a diffusers `tokenizer/` directory

The LLM's loader (T5Gemma) is mmgen.llm.models.t5gemma_loading; it uses safetensors_dir from here.
"""
