"""Convert checkpoints between Hugging Face and Megatron-Core (the same as ``megatron-rl convert``).

python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out MCORE_DIR --tp 2 --pp 1
python tools/convert_checkpoint.py mcore-to-hf --mcore MCORE_DIR --out HF_DIR
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout
    from megatron_rl.convert.cli import main
    from megatron_rl.errors import run_cli

    sys.exit(run_cli("megatron-rl convert", main))
