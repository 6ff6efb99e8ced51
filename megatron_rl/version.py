"""The version of megatron-rl, written once: the package root re-exports it
(``megatron_rl.__version__``), ``setup.py`` reads it from this file without importing the package,
and every training checkpoint records it in its marker (:mod:`megatron_rl.training.checkpoint`).

A leaf that imports nothing: any module reads the version from here, never from the package root
(which re-exports the Python API of the top layer).
"""

__version__ = "0.1.0"
