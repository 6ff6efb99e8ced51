"""The trainer side: Megatron-Core policy built from an HF config, its parallel layout and process
groups, and the CPU adaptation that lets all of it run over gloo without a GPU.

Modules (imported directly; this package imports nothing heavy):

- ``parallel``: ``ParallelConfig``, ``init_parallel``, ``destroy_parallel``, ``process_groups``.
- ``model``: ``transformer_config_from_hf``, ``build_gpt_model``, ``build_model_chunks``,
  ``padded_vocab_size``, ``save_model_checkpoint``, ``load_model_checkpoint``.
- ``cpu_compat``: ``apply_cpu_compat`` (called by ``init_parallel`` when CUDA is absent).
- ``config``: ``TrainerConfig``, ``OptimConfig``.
- ``steps``: forward steps and loss closures handed to Megatron's pipeline schedule.
- ``trainer``: ``PolicyTrainer`` (``rl_step``, ``sft_step``, ``compute_logprobs``).
- ``checkpoint``: ``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint`` (atomic, exact resume).
"""
