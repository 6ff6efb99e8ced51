"""The RL loop (layer 7): ``recipe`` (``RunConfig``, the whole recipe, checked at load),
``config`` (the loop's own sections), ``problem_sets`` (the recipe's data, read and checked),
``sampler`` (seeded prompt order), ``rollouts`` (groups in flight, scored, filtered) with
``group_record`` (one group's record and seeds) and ``scoring`` (the verifier pool's side, every
sample scored by a deadline), ``loop`` (``Orchestrator``: async / sync steps, in-flight weight
updates), ``run`` (``megatron-rl train``: set-up, resume, metrics, export) with ``curriculum``
(stages applied as the run goes) and ``run_records`` (config snapshot, samples and ledger, plots).
Modules are imported directly; this package imports nothing heavy."""
