"""Hugging Face models as every other part sees them (layer 2): ``arch`` (what an HF config says:
supported families, RoPE, vocabulary padding), ``layout`` (the HF <-> Megatron name and shape map,
one converter per architecture, used by the trainer, the weight broadcast and the offline converter
alike), ``tensor_maps`` (the tables it is built from: names and shapes, family by family),
``sharding`` (how a full tensor splits over tensor- and pipeline-parallel ranks) and ``files``
(safetensors folders read and written shard by shard).

Modules are imported directly; this package imports nothing heavy."""
