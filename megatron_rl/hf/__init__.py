"""Hugging Face models as every other part sees them (layer 1): ``arch`` (what an HF config says:
supported families, RoPE, vocabulary padding), ``layout`` (the HF <-> Megatron name, shape and
TP/PP layout map, one converter per architecture, used by the trainer, the weight broadcast and
the offline converter alike) and ``files`` (safetensors folders read and written shard by shard).

Modules are imported directly; this package imports nothing heavy."""
