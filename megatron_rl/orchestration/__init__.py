"""The RL loop (layer 6): ``recipe`` (``RunConfig``, the whole recipe, checked at load),
``config`` (the loop's own sections), ``sampler`` (seeded prompt order), ``rollouts`` (groups in
flight, scored, filtered), ``loop`` (``Orchestrator``: async / sync steps, in-flight weight
updates), ``run`` (``megatron-rl train``: set-up, resume, curriculum, metrics, export). Modules are
imported directly; this package imports nothing heavy."""
