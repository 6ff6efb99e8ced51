import sys

from megatron_rl.rewards.cli import main

sys.exit(main())
