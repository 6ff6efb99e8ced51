"""megatron-rl: reinforcement learning from verifiable rewards at cluster scale, after Magistral."""

__version__ = "0.1.0"
