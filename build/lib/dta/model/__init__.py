"""The model interface: everything the walk assumes about a Hugging Face causal LM (the
decoder, its attention pieces and K/V cache, recurrent layers, MoE routing, the LM head,
LoRA, the family registry)."""
