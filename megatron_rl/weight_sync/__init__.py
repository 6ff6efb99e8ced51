"""Weights from the trainer to the generators: ``broadcast`` (``WeightBroadcaster``: HF-named
tensors from the trainer, bucketed, broadcast over the update group to every server while they
pause in place). The HF name map is :mod:`megatron_rl.hf.layout`; the update group is
:mod:`megatron_rl.generation.update_group`."""
