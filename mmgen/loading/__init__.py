"""Checkpoints from local disk into mmgen's diffusion models (imports: models; never llm/, render/ or pipelines/).

safetensors_dir  single-file or sharded safetensors, assigned to a module's parameters by name
wan_components   what a loaded Wan model is (WanComponents), its generation defaults, cross-component checks
diffusers_dir    a diffusers-format Wan directory: model_index.json, configs, components (or original_dir's)
wan_transformer  the Wan DiT from diffusers-format or original-Wan-format keys
original_dir     an original-layout Wan2.2 A14B or Wan2.1 (T2V, VACE) repository (DiT, VAE and T5 .pth) as a whole
wan_vace         the Wan2.1 VACE DiT (diffusers or original keys); load_wan_dit picks VACE or plain
umt5             the UMT5 encoder from a transformers-format directory
tokenizer        the `tokenizers` tokenizer of a diffusers `tokenizer/` directory

The LLM's loader (T5Gemma) is mmgen.llm.models.t5gemma_loading; it uses safetensors_dir from here.
"""
