"""Multi-turn environments: conversations that answer back, and the exact tokens of a trajectory.

- :mod:`~megatron_rl.environments.config`: ``env.*`` of the recipe (:class:`EnvConfig`);
- :mod:`~megatron_rl.environments.calls`: the environment contract (``reset`` / ``step`` /
  ``score``, plain or ``async def``), the class a recipe names, and its calls run with a deadline
  and checked, so an environment that raises, hangs or returns garbage ends its trajectory with a
  counted reason and never the run;
- :mod:`~megatron_rl.environments.tokens`: the environment's turns rendered through the model's
  chat template as token deltas appended after the model's own sampled ids (never re-encoded),
  and the check that a template is append-only;
- :mod:`~megatron_rl.environments.trajectory`: one trajectory as one list of token ids with its
  loss mask, behaviour log-probs and per-token policy versions, and the driver that runs it;
- :mod:`~megatron_rl.environments.python_tool`: a Python interpreter tool in the code sandbox.

Layer 3 (beside ``batching``): built on ``rewards`` (the sandbox, the template helpers, the
loader of recipe-named code) and the records of ``types``.
"""
