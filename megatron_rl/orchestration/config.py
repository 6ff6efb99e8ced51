"""Configuration of a run: the loop, the data, the fleet, the model, the run directory and the
curriculum. These are sections of :class:`megatron_rl.config.RunConfig` (``loop:``, ``data:``,
``fleet:``, ``model:``, ``run:``, ``curriculum:``), next to ``algorithm``, ``batching``,
``reward``, ``trainer`` and ``weight_sync``."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config import ConfigFieldError, YamlValue, check_choice, check_range
from megatron_rl.data.problems import MAPPABLE_FIELDS
from megatron_rl.generation.protocol import api_key_from_env, check_api_key, check_server_url

__all__ = [
    "DataConfig",
    "FleetConfig",
    "LoopConfig",
    "ModelConfig",
    "RunDirConfig",
    "StageConfig",
    "check_server_urls",
]


@dataclass(kw_only=True)
class LoopConfig:
    """The asynchronous GRPO loop (Magistral section 3): sizes are in *sequences*."""

    # async: generators never wait; sync: for comparison; colocated: sync, with the fleet's memory
    # released while the trainer runs and weights pushed by reference (one node, shared devices)
    mode: Literal["async", "sync", "colocated"] = "async"
    group_size: int = 16  # G completions per prompt
    n_batch: int = 256  # sequences per training step (whole groups: a multiple of group_size)
    n_minibatch: int = 0  # sequences per optimizer step; 0 = n_batch (one step per batch)
    n_async: int = 512  # most sequences generating at once across the fleet
    max_async_ratio: float = 2.0  # n_async / n_batch is capped at this
    queue_groups: int = 0  # bounded queue of verified groups; 0 = n_batch / group_size
    # Drop (and re-issue) groups with a token more than this many versions old; -1 = never, the
    # paper's recipe: n_async and the bounded queue bound the off-policy degree, the clipped ratio
    # corrects it, and a bound would drop exactly the longest completions (a length bias).
    max_staleness: int = -1
    max_steps: int = 100  # training steps (batches) of the run
    top_p: float = 1.0  # nucleus sampling (temperature is algorithm.temperature)
    expected_length: int = 0  # completion tokens assumed for KV sizing before any finishes; 0 = l_max/2
    seed: int = 0  # prompt order and per-request sampling seeds
    # Stop with a diagnosis when this many batches' worth of groups in a row are all dropped
    # (no batch could ever fill; rollouts.NoProgressError); 0 = wait forever.
    max_dropped_batches: int = 8

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ("async", "sync", "colocated"))
        check_range("group_size", self.group_size, low=2)
        check_range("n_batch", self.n_batch, low=self.group_size)
        if self.n_batch % self.group_size:
            raise ConfigFieldError(
                "n_batch", f"must be a multiple of group_size ({self.group_size}), got {self.n_batch}"
            )
        check_range("n_minibatch", self.n_minibatch, low=0, high=self.n_batch)
        if self.n_minibatch and (self.n_batch % self.n_minibatch or self.n_minibatch % self.group_size):
            raise ConfigFieldError(
                "n_minibatch",
                f"must divide n_batch ({self.n_batch}) and be a "
                f"multiple of group_size, got {self.n_minibatch}",
            )
        check_range("n_async", self.n_async, low=self.group_size)
        check_range("max_async_ratio", self.max_async_ratio, low=0.0, low_open=True)
        check_range("queue_groups", self.queue_groups, low=0)
        check_range("max_staleness", self.max_staleness, low=-1)
        check_range("max_steps", self.max_steps, low=0)
        check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_range("expected_length", self.expected_length, low=0)
        check_range("max_dropped_batches", self.max_dropped_batches, low=0)

    @property
    def minibatch(self) -> int:
        return self.n_minibatch or self.n_batch

    def async_cap(self) -> int:
        """``n_async`` with the ratio cap applied (whole groups)."""
        cap = min(self.n_async, int(self.max_async_ratio * self.n_batch))
        return max(self.group_size, cap - cap % self.group_size)

    def staleness_bound(self) -> int | None:
        """Versions a group's oldest token may lag before the group is dropped; None = no bound."""
        return self.max_staleness if self.max_staleness >= 0 else None

    def stall_groups(self) -> int:
        """Groups dropped in a row that stop the run (0: never); see ``max_dropped_batches``."""
        return self.max_dropped_batches * self.n_batch // self.group_size

    def queue_capacity(self) -> int:
        return self.queue_groups or self.n_batch // self.group_size


@dataclass(kw_only=True)
class DataConfig:
    """Problems: a JSONL / JSON / CSV / Parquet file, a folder written by ``datasets``'
    ``save_to_disk``, or ``hf:NAME[:SPLIT]`` (fields: id, problem, answer or tests, task,
    optional language / difficulty; other names through ``columns``)."""

    train: str = ""  # training problems
    eval: str = ""  # held-out problems for pass@1 (optional)
    # Our field -> your column, for data with its own names ({problem: question, answer:
    # final_answer, id: uid}); a dotted column reads a nested field (reward_model.ground_truth).
    # Applied to train and eval; columns not mapped stay in the problem's meta.
    columns: dict[str, str] = field(default_factory=dict)
    # The split of a datasets folder to train on; "" = its only split, else "train".
    split: str = ""
    eval_split: str = ""  # the split of a datasets folder given as eval; "" = its only split
    # Keep only training records whose column (your name, as in the file) equals the value, or
    # one of a list of values ({source: [gsm8k, math], lang: en}); {} = all.
    where: dict[str, YamlValue] = field(default_factory=dict)
    limit: int = 0  # train on the first this many problems of train (after where); 0 = all
    # With eval empty: hold this fraction of train out as the eval set (0 = none), chosen by a
    # hash of (holdout_seed, problem id), so it does not move when the file is reordered.
    eval_fraction: float = 0.0
    holdout_seed: int = 0  # the seed of that hash: another seed holds out other problems
    # "paper" (Magistral's, with reward.think_tags), "none", or the text itself ({think_open} and
    # {think_close} in it stand for reward.think_tags)
    system_prompt: str = "paper"
    # auto: prompts through the tokenizer's chat template when it has one (system prompt as the
    # system message, generation prompt appended), else plain text; none: plain text always.
    chat_template: Literal["auto", "none"] = "auto"
    min_difficulty: float | None = None  # keep problems with difficulty >= this (curriculum)
    max_difficulty: float | None = None  # keep problems with difficulty <= this
    drop_solved: bool = False  # a prompt whose whole group was correct is not sampled again
    shuffle: bool = True  # new permutation every epoch (seeded)

    def __post_init__(self) -> None:
        sources: dict[str, str] = {}
        for ours, theirs in self.columns.items():
            if ours not in MAPPABLE_FIELDS:
                raise ConfigFieldError(
                    f"columns.{ours}", f"not a field of a problem (map one of: {', '.join(MAPPABLE_FIELDS)})"
                )
            if not isinstance(theirs, str) or not theirs.strip():
                raise ConfigFieldError(f"columns.{ours}", f"expected the name of a column, got {theirs!r}")
            if theirs in sources:
                raise ConfigFieldError(
                    f"columns.{ours}", f"column {theirs!r} is already mapped to {sources[theirs]}"
                )
            sources[theirs] = ours
        for column, wanted in self.where.items():
            values = wanted if isinstance(wanted, list) else [wanted]
            if not values or not all(v is None or isinstance(v, (str, int, float, bool)) for v in values):
                raise ConfigFieldError(
                    f"where.{column}", f"expected a value or a non-empty list of values, got {wanted!r}"
                )
        check_range("limit", self.limit, low=0)
        check_range("eval_fraction", self.eval_fraction, low=0.0, high=1.0, high_open=True)
        if self.eval_fraction and self.eval:
            raise ConfigFieldError(
                "eval_fraction",
                f"holds part of train out when eval is empty, but eval is set ({self.eval!r})",
            )
        if self.eval_split and not self.eval:
            raise ConfigFieldError("eval_split", "names a split of eval, but eval is empty")
        check_choice("chat_template", self.chat_template, ("auto", "none"))
        for name in ("min_difficulty", "max_difficulty"):
            value = getattr(self, name)
            if value is not None:
                check_range(name, value)


def check_server_urls(value: object, field: str) -> None:
    """A list of server URLs, each ``http://HOST[:PORT][/PATH]`` (or https): no port 0, user,
    query or fragment; the entry named (``urls[1]``) when one is not."""
    if not isinstance(value, list):
        raise ConfigFieldError(field, f"must be a list of server URLs, got {value!r}")
    for i, url in enumerate(value):
        try:
            check_server_url(url)
        except ValueError as e:
            raise ConfigFieldError(f"{field}[{i}]", str(e)) from None


@dataclass(kw_only=True)
class FleetConfig:
    """Where generation runs: servers already up (``urls``), or built-in engines we start."""

    urls: list = field(default_factory=list)  # SGLang / serve-engine servers (or one router)
    update_urls: list = field(default_factory=list)  # weight-update targets; [] = urls
    local_servers: int = 1  # built-in engine servers to start when urls is empty
    max_slots: int = 16  # per local server: sequences decoded together
    max_len: int = 2048  # per local server: prompt + completion tokens per slot
    threads: int = 1  # per local server: torch threads
    # Seconds a generation may take before it is aborted on its server and re-issued (finite:
    # a request that never ends would hold its group forever; generous: long traces are normal).
    request_timeout_s: float = 3600.0
    # The servers' API key (sent as "Authorization: Bearer KEY", as SGLang's --api-key wants);
    # "" = $MEGATRON_RL_API_KEY, and if that is unset too: none for urls, a random one for the
    # local servers (they are never open). Never written to the run directory's config.yaml.
    api_key: str = ""
    # Reproducible sampling: every request carries a seed, but SGLang uses it only when started
    # with --enable-deterministic-inference (slower kernels). true: the launch scripts pass that
    # flag (`megatron-rl sglang-args`), and the client refuses a server that reports it off.
    deterministic: bool = False
    # A group's G samples in one /generate (SGLang's batch form) instead of one request each:
    # the orchestrator's work per completion falls (one HTTP request per group) and the server
    # prefills the prompt once. The built-in engine streams each sample back as it ends; SGLang
    # answers the batch whole, so a group's slots count as in flight until its longest sample
    # ends and at equal n_async fewer sequences decode. auto: per group where every server
    # streams (the built-in engine), per sample elsewhere (docs/scale.md).
    group_requests: bool | Literal["auto"] = "auto"
    # A fleet that heals (orchestration/fleet_health.py): a local server that dies is started
    # again on its port, at most this many times each; an external one is asked /health with
    # back-off. Either takes work again only once the trainer's weights reached it.
    max_restarts: int = 3
    # The run stops (exit 1, one line) when no server has been reachable for this long; until
    # then, generations that find no server wait for one.
    dead_fleet_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_range("max_restarts", self.max_restarts, low=0)
        check_range("dead_fleet_timeout_s", self.dead_fleet_timeout_s, low=0.0, low_open=True)
        try:
            check_api_key(self.api_key)
        except ValueError as e:
            raise ConfigFieldError("api_key", str(e).removeprefix("api_key: ")) from None
        check_range("local_servers", self.local_servers, low=0)
        check_range("max_slots", self.max_slots, low=1)
        check_range("max_len", self.max_len, low=2)
        check_range("request_timeout_s", self.request_timeout_s, low=0.0, low_open=True)
        check_range("threads", self.threads, low=1)
        check_choice("group_requests", self.group_requests, ("auto", True, False))
        if not self.urls and not self.local_servers:
            raise ConfigFieldError("local_servers", "must be >= 1 when no urls are given")
        check_server_urls(self.urls, "urls")
        check_server_urls(self.update_urls, "update_urls")

    def resolved_api_key(self) -> str:
        """``api_key``, else ``$MEGATRON_RL_API_KEY``; "" when neither is set."""
        return self.api_key or api_key_from_env()


@dataclass(kw_only=True)
class ModelConfig:
    """The initial policy: an HF folder (config, safetensors, tokenizer)."""

    # HF folder the trainer starts from and local servers load, or a Hub id (owner/name) that the
    # local Hugging Face cache holds (never downloaded; a GGUF file: megatron-rl convert gguf-to-hf)
    hf: str = ""
    tokenizer: str = ""  # tokenizer folder or cached Hub id; "" = the hf folder


@dataclass(kw_only=True)
class RunDirConfig:
    """The run directory: snapshot, metrics, samples, checkpoints."""

    dir: str = "runs/default"  # the run directory: config, metrics, samples, checkpoints, plots
    resume: Literal["auto", "never", "must"] = "auto"  # auto: resume if a checkpoint exists
    checkpoint_every: int = 10  # steps between checkpoints (0: only at the end)
    keep_last: int = 2  # checkpoints kept
    save_samples: bool = True  # samples.jsonl (every scored completion, for SFT traces later)
    # Where metrics, the resolved config and the plots go besides metrics.jsonl (always
    # written): any of jsonl, tensorboard, wandb, mlflow (orchestration/trackers.py).
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb_project: str = "megatron-rl"  # the W&B project (run.trackers: wandb; offline)
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # offline: RUN/wandb, no network
    mlflow_uri: str = ""  # tracking URI; "" = the file store RUN/mlruns
    mlflow_experiment: str = "megatron-rl"  # the MLflow experiment (run.trackers: mlflow)
    eval_every: int = 0  # held-out pass@1 every this many steps (0: before and after only)
    eval_samples: int = 0  # held-out problems evaluated (0: all)
    eval_k: int = 1  # samples per held-out problem (pass@1 is their mean)
    # Wall-clock limit of one invocation (set-up included), in minutes: the run ends by then as if
    # it had reached max_steps (checkpoint, export, final eval, summary); running it again
    # resumes. Training stops early enough to leave the final evaluation the time the latest one
    # took (a step starts only if, trained as long as the latest, it ends before that); whatever still runs at the limit stops there: a step waiting for its batch (not
    # trained, its prompts re-issued on resume), an evaluation (its unscored samples counted as
    # time_limit, the record marked partial). 0: no limit.
    time_limit_min: float = 0.0
    # Preemption (SIGTERM, SIGUSR1, or a file RUN/STOP): the step under way finishes (or, still
    # waiting for its batch, is abandoned), then a checkpoint and summary.json are written and the
    # run exits 0, all within this many seconds of the signal; past them it stops at once (exit
    # 1, no new checkpoint: the previous one stays the latest). Cluster schedulers kill after
    # their own grace (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds): keep below it.
    preempt_grace_s: float = 120.0

    def __post_init__(self) -> None:
        check_range("checkpoint_every", self.checkpoint_every, low=0)
        check_range("time_limit_min", self.time_limit_min, low=0.0)
        check_range("preempt_grace_s", self.preempt_grace_s, low=1.0)
        check_range("keep_last", self.keep_last, low=1)
        check_range("eval_every", self.eval_every, low=0)
        check_range("eval_k", self.eval_k, low=1)
        check_choice("wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
        for name in self.trackers:
            check_choice("trackers", name, ("jsonl", "tensorboard", "wandb", "mlflow"))


# What metrics.jsonl's records hold (the loop's Orchestrator._metrics, the trainer's step stats,
# the weight update's, the run's own): names, and families whose members depend on the run (a
# reward part, a drop reason, the trainer's statistics). A curriculum stage on any other metric
# could never trigger; tests/orchestration/test_loop.py checks every key a real run logs is here.
LOGGED_METRICS = ("step", "pass_rate", "format_rate", "sequences", "in_flight", "async_cap")
LOGGED_FAMILIES = (
    "reward/",
    "length/",
    "groups/",
    "train/",
    "staleness/",
    "queue/",
    "generator/",
    "throughput/",
    "time/",
    "requests/",
    "samples/reason/",
    "env/",
    "weight_sync/",
    "colocate/",
    "version/",
    "curriculum/",
    "fleet/",
)


def is_logged_metric(name: str) -> bool:
    """Whether the loop can log a metric of this name (see ``LOGGED_METRICS``)."""
    return name in LOGGED_METRICS or any(name.startswith(f) and len(name) > len(f) for f in LOGGED_FAMILIES)


@dataclass(kw_only=True)
class StageConfig:
    """A curriculum stage: starts at ``at_step``, or once ``metric`` crosses ``threshold``
    (mean over the last ``window`` steps); every field left unset keeps its value."""

    name: str = ""  # shown in the log and in errors about this stage
    at_step: int | None = None  # the training step (batch) the stage starts at (or metric + threshold)
    metric: str | None = None  # e.g. "reward/correct" or "length/mean"
    threshold: float | None = None  # the value the metric's mean must cross
    above: bool = True  # trigger when the metric is >= threshold (False: <=)
    window: int = 3  # steps the metric's mean is taken over
    l_max: int | None = None  # reward.l_max and the generation limit
    l_cache: int | None = None  # reward.l_cache
    n_batch: int | None = None  # loop.n_batch
    n_minibatch: int | None = None  # loop.n_minibatch
    n_async: int | None = None  # loop.n_async
    eps_high: float | None = None  # algorithm.eps_high
    min_difficulty: float | None = None  # data.min_difficulty
    max_difficulty: float | None = None  # data.max_difficulty
    drop_solved: bool | None = None  # data.drop_solved

    def __post_init__(self) -> None:
        if (self.at_step is None) == (self.metric is None):
            raise ConfigFieldError(
                "at_step", "a stage needs exactly one trigger: at_step, or metric + threshold"
            )
        if self.metric is not None and self.threshold is None:
            raise ConfigFieldError("threshold", f"required with metric {self.metric!r}")
        if self.metric is not None and not is_logged_metric(self.metric):
            close = difflib.get_close_matches(
                self.metric, [*LOGGED_METRICS, "reward/mean", "length/mean"], n=1
            )
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigFieldError(
                "metric",
                f"{self.metric!r} is not a metric the loop logs{hint} (a key of metrics.jsonl: "
                f"{', '.join(LOGGED_METRICS)}, or {', '.join(f + '...' for f in LOGGED_FAMILIES)})",
            )
        check_range("window", self.window, low=1)
        check_choice("above", self.above, (True, False))
