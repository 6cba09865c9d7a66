"""The tests' own key map between diffusers' WanTransformer3DModel and the original Wan layout."""

from __future__ import annotations


def diffusers_to_original_key(key: str) -> str:
    """diffusers -> original Wan repository key (image-path keys included), written independently of
    mmgen.loading's map; test_wan_dit_parity checks it against diffusers' own converter."""
    pairs = [
        ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
        ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
        ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
        ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
        ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
        ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
        ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
        ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
        ("condition_embedder.time_proj.", "time_projection.1."),
        ("proj_out.", "head.head."),
        (".attn2.add_k_proj.", ".cross_attn.k_img."),
        (".attn2.add_v_proj.", ".cross_attn.v_img."),
        (".attn2.norm_added_k.", ".cross_attn.norm_k_img."),
        (".attn1.to_out.0.", ".self_attn.o."),
        (".attn2.to_out.0.", ".cross_attn.o."),
        (".attn1.to_", ".self_attn."),
        (".attn2.to_", ".cross_attn."),
        (".attn1.", ".self_attn."),
        (".attn2.", ".cross_attn."),
        (".norm2.", ".norm3."),
        (".ffn.net.0.proj.", ".ffn.0."),
        (".ffn.net.2.", ".ffn.2."),
    ]
    if key == "scale_shift_table":
        return "head.modulation"
    if key.endswith(".scale_shift_table"):
        return key.replace(".scale_shift_table", ".modulation")
    for new, old in pairs:
        if new in key:
            return key.replace(new, old)
    return key
