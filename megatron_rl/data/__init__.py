"""Problem sets and their curation: records and readers (``problems``), a run's samples file
(``rundir``), sampling through a generator (``sampling``), format / difficulty / code-test
curation, the translation hook, SFT trace collection, benchmark loaders and ``megatron-rl curate``
(``cli``). Tiny made-up samples of every input format ship in ``samples/``."""
