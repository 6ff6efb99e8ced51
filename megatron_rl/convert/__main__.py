"""``python -m megatron_rl.convert``: the same as ``megatron-rl convert``."""

import sys

from megatron_rl.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
