"""``python -m megatron_rl.convert``: the same as ``megatron-rl convert``."""

import sys

from megatron_rl.convert.cli import main
from megatron_rl.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli("megatron-rl convert", main))
