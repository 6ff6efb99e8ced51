"""The reward (layer 2): ``format`` (the ``<think>`` template and ``\\boxed{}``), ``math``
(math-verify on SymPy), ``code`` (tests run in ``sandbox``, its backends ``sandbox_bwrap`` and
``sandbox_plain``, its users ``sandbox_uids``), ``length`` (soft penalty),
``language`` (fastText consistency), ``compose`` (RewardConfig, the total and its parts), ``custom``
(your own reward, ``reward.custom``), ``pool``
(verifier processes with hard per-task limits), ``remote`` and ``remote_server`` (a pool that
spans nodes: verifier servers, ``reward.remote``), ``result`` (verdicts and reasons), ``template``
(the system prompt). Modules are imported directly; this package imports nothing heavy."""
