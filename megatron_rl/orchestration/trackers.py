"""Experiment trackers: where a run's metrics, resolved config and plots go besides the run
directory's own ``metrics.jsonl`` (always written: resume and the plots read it).

``run.trackers`` in a recipe names them; each is an optional install that works offline:

=============  ===============================================  =============================
name           writes                                           install
=============  ===============================================  =============================
tensorboard    ``RUN/tb`` events                                ``pip install tensorboard``
wandb          a W&B run; ``run.wandb_mode: offline`` (default)  ``pip install wandb``
               keeps it in ``RUN/wandb`` (``wandb sync`` later)
mlflow         an MLflow run; ``run.mlflow_uri`` ("" = the      ``pip install mlflow-skinny``
               file store ``RUN/mlruns``); ``/`` in a metric
               name becomes ``.`` (``reward.mean``)
=============  ===============================================  =============================

Every tracker gets the same calls: :meth:`Tracker.config` once (the resolved recipe, secrets
masked), :meth:`Tracker.log` per step (the same metrics as ``metrics.jsonl``),
:meth:`Tracker.artifact` for each plot at the end, :meth:`Tracker.close`. A tracker that is
named but not installed is refused when the run starts (:func:`check_trackers`), never halfway.
A resumed run continues the same W&B run (its id is kept in ``RUN/wandb/run_id``) and the same
MLflow run (``RUN/mlruns/run_id``).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from megatron_rl.fileio import atomic_write_text

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["TRACKERS", "Tracker", "check_trackers", "open_trackers"]

#: tracker name -> the module it needs and how to install it.
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow-skinny"),
}


class Tracker(ABC):
    """One experiment tracker (see the module docstring)."""

    name: str

    @abstractmethod
    def config(self, cfg: Mapping[str, Any]) -> None:
        """The resolved recipe (nested; secrets already masked)."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """One step's metrics."""

    def artifact(self, path: Path) -> None:  # noqa: B027 - optional: not every tracker keeps files
        """A file of the run (a plot); trackers that keep files store a copy."""

    @abstractmethod
    def close(self) -> None:
        """Flush and finish (the run can be resumed later)."""


def check_trackers(names: list[str]) -> None:
    """Raise ``ValueError`` naming ``run.trackers`` if a tracker is unknown or not installed."""
    for name in names:
        if name == "jsonl":  # metrics.jsonl: always written
            continue
        if name not in TRACKERS:
            raise ValueError(f"run.trackers: unknown tracker {name!r}; known: jsonl, {', '.join(TRACKERS)}")
        module, install = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"run.trackers: {name} is not installed ({install})")


def _flat(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


class _TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: optional (run.trackers)

        self.w = SummaryWriter(str(run_dir / "tb"))

    def config(self, cfg: Mapping[str, Any]) -> None:
        import yaml  # lazy: only the config text needs it

        self.w.add_text("config", "```\n" + yaml.safe_dump(dict(cfg), sort_keys=False) + "```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _WandB(Tracker):
    name = "wandb"

    def __init__(
        self, run_dir: Path, *, project: str, mode: Literal["offline", "online", "disabled"], name: str
    ) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # lazy: optional (run.trackers)

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)  # W&B's id form
        self.run = wandb.init(
            project=project, name=name, id=run_id, resume="allow", mode=mode, dir=str(run_dir)
        )
        if not id_file.exists():
            atomic_write_text(id_file, run_id)

    def config(self, cfg: Mapping[str, Any]) -> None:
        self.run.config.update(dict(cfg), allow_val_change=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def artifact(self, path: Path) -> None:
        import wandb  # lazy: optional (run.trackers)

        self.run.log({f"plots/{path.stem}": wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


class _MLflow(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, *, uri: str, experiment: str, name: str) -> None:
        # MLflow 3 keeps its file store for offline use behind this switch; it is our default.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # lazy: optional (run.trackers)

        store = run_dir / "mlruns"
        self.uri = uri or store.resolve().as_uri()
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        store.mkdir(parents=True, exist_ok=True)
        id_file = store / "run_id"
        self._params_logged = False
        if id_file.exists():  # a resumed run: the same MLflow run, its params already set
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            self._params_logged = bool(self.client.get_run(self.run_id).data.params)
        else:
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            atomic_write_text(id_file, self.run_id)

    def config(self, cfg: Mapping[str, Any]) -> None:
        if self._params_logged:  # params are immutable in MLflow; a resumed run keeps them
            return
        from mlflow.entities import Param  # lazy: optional (run.trackers)

        # MLflow caps a param value at 6000 characters and a batch at 100 params.
        params = [Param(k, str(v)[:6000]) for k, v in _flat(cfg).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self._params_logged = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric  # lazy: optional (run.trackers)

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="plots")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """``reward/mean`` -> ``reward.mean``: MLflow's file store makes ``/`` a folder, so
    ``groups/dropped`` beside ``groups/dropped/all_wrong`` would be a file and a folder at once;
    characters MLflow refuses (``@``, ``%``) become ``_``."""
    return "".join(c if c.isalnum() or c in "_-. " else "." if c == "/" else "_" for c in key)


def open_trackers(
    names: list[str],
    run_dir: Path,
    *,
    run_name: str,
    wandb_project: str = "megatron-rl",
    wandb_mode: Literal["offline", "online", "disabled"] = "offline",
    mlflow_uri: str = "",
    mlflow_experiment: str = "megatron-rl",
) -> list[Tracker]:
    """The trackers ``names`` names (``jsonl`` is the run directory's own and needs none)."""
    check_trackers(names)
    out: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                out.append(_TensorBoard(run_dir))
            elif name == "wandb":
                out.append(_WandB(run_dir, project=wandb_project, mode=wandb_mode, name=run_name))
            elif name == "mlflow":
                out.append(_MLflow(run_dir, uri=mlflow_uri, experiment=mlflow_experiment, name=run_name))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out
