"""The trainer side: Megatron-Core policy built from an HF config, its parallel layout and process
groups, and the CPU adaptation that lets all of it run over gloo without a GPU.

The errors a caller of the trainer handles are exported here: ``NonFiniteError`` (NaN/inf loss or
gradient norm too many steps in a row, or weights given to a save), ``CheckpointError`` and its
``CheckpointCorruptError`` (a checkpoint that fails its manifest), ``CheckpointMismatchError``.

Modules (imported directly; importing this package costs torch, not megatron-core):

- ``parallel``: ``ParallelConfig``, ``init_parallel``, ``destroy_parallel``, ``process_groups``.
- ``model``: ``transformer_config_from_hf``, ``build_gpt_model``, ``build_model_chunks``,
  ``padded_vocab_size``, ``save_model_checkpoint``, ``load_model_checkpoint``.
- ``cpu_compat``: ``apply_cpu_compat`` (called by ``init_parallel`` when CUDA is absent).
- ``config``: ``TrainerConfig``, ``OptimConfig``.
- ``steps``: forward steps and loss closures handed to Megatron's pipeline schedule.
- ``trainer``: ``PolicyTrainer`` (``rl_step``, ``sft_step``, ``compute_logprobs``).
- ``checkpoint``: ``save_checkpoint``, ``load_checkpoint`` (atomic, exact resume, verified
  against a manifest); ``checkpoint_manifest``: ``latest_checkpoint``, ``list_checkpoints`` (the
  folders on disk, the manifest, ``latest`` and the fallback); ``checkpoint_rng``,
  ``checkpoint_collectives``, ``checkpoint_io``: the parts the save and load are built from.
"""

from megatron_rl.training.checkpoint import CheckpointMismatchError, NonFiniteError
from megatron_rl.training.checkpoint_manifest import CheckpointCorruptError, CheckpointError

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "NonFiniteError"]
