"""Evaluation: unbiased pass@k, maj@k and length statistics (``metrics``), JSON / Markdown / PNG
reports (``report``, ``plots``), ``megatron-rl eval`` (``cli``) and training-run analysis
(``analysis``: reward against length, weight-trajectory PCA)."""
