"""What ``train`` checks before it starts anything: the mistakes that would otherwise surface minutes
later as a failed generation or a weight sync with no server, each named by its recipe field.

- :func:`check_fleet_reachable`: every ``fleet.urls`` / ``fleet.update_urls`` entry answers an
  HTTP request within a bounded probe (the URL and why not named): a server that is not there
  is a recipe mistake, not a run that waits ``fleet.dead_fleet_timeout_s`` and then stops.
- :func:`check_vocabulary`: the tokenizer's ids fit the model's embedding (``vocab_size``), since
  an id past it is refused by every engine at the first request.
- :func:`check_prompt_lengths`: with local engine servers (whose context is ``fleet.max_len``),
  the longest prompt of the training and held-out sets plus the longest generation the recipe
  asks for (``reward.l_max``, and any curriculum stage's) fits one slot.

Each raises :class:`~megatron_rl.config.ConfigFieldError` (exit 2, one line).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from megatron_rl.config import ConfigFieldError
from megatron_rl.data.sampling import render_prompt
from megatron_rl.errors import InputError
from megatron_rl.generation.transport import unreachable
from megatron_rl.hf.arch import language_model_dict
from megatron_rl.hf.files import read_config_json

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.data.problems import Problem
    from megatron_rl.orchestration.recipe import RunConfig

__all__ = ["PROBE_TIMEOUT_S", "check_fleet_reachable", "check_prompt_lengths", "check_vocabulary"]

#: Seconds each server has to answer the start-up probe. Launch scripts wait for /health before
#: they start the trainer (examples/launch/), so a server that does not answer in this long is
#: not there: a wrong host or port, or one that died.
PROBE_TIMEOUT_S = 10.0


def check_fleet_reachable(cfg: RunConfig, *, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Every URL of ``fleet.urls`` and ``fleet.update_urls`` answers ``GET /health`` (any HTTP
    status) within ``timeout_s``, probed concurrently; the first that does not is named."""
    named = [(f"fleet.urls[{i}]", u) for i, u in enumerate(cfg.fleet.urls)]
    named += [(f"fleet.update_urls[{i}]", u) for i, u in enumerate(cfg.fleet.update_urls)]
    if not named:
        return
    with ThreadPoolExecutor(max_workers=min(32, len(named))) as pool:
        why = list(pool.map(lambda nu: unreachable(nu[1], timeout_s), named))
    for (field, url), reason in zip(named, why, strict=True):
        if reason is not None:
            raise ConfigFieldError(
                field,
                f"nothing answers at {url} ({reason}); start the server first (launch scripts wait "
                "for its /health), or correct the address",
            )


def model_vocab_size(hf_folder: str) -> int | None:
    """``vocab_size`` of the language model in ``hf_folder``'s config.json (None if it names none)."""
    config = read_config_json(hf_folder, flag="model.hf")
    try:
        vocab = language_model_dict(config).get("vocab_size")
    except ValueError as e:
        raise InputError(f"model.hf {hf_folder}: {e}") from None
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, cfg: RunConfig) -> None:
    """The tokenizer's largest id is below the model's ``vocab_size`` (a model may have more rows
    than its tokenizer has ids: padding; never fewer)."""
    vocab = model_vocab_size(cfg.model.hf)
    if vocab is None:
        return
    ids = tokenizer.get_vocab().values()
    top = max(ids, default=-1)
    if top >= vocab:
        field, name = ("tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("hf", cfg.model.hf)
        raise ConfigFieldError(
            f"model.{field}",
            f"the tokenizer of {name} has ids up to {top}, but the model {cfg.model.hf} embeds only "
            f"{vocab} (config.json vocab_size): the tokenizer belongs to another model",
        )


def longest_generation(cfg: RunConfig) -> int:
    """The most tokens a completion may be asked for: ``reward.l_max``, or a curriculum stage's."""
    stages = [st.l_max for st in cfg.curriculum if st.l_max is not None]
    return max([cfg.reward.l_max, *stages])


def check_prompt_lengths(
    tokenizer: PreTrainedTokenizerBase,
    cfg: RunConfig,
    system_prompt: str,
    problem_sets: Sequence[tuple[str, Iterable[Problem]]],
) -> None:
    """With local servers (``fleet.urls`` empty): every prompt of ``problem_sets`` (``(field,
    problems)``, e.g. ``("data.train", ...)``) plus :func:`longest_generation` fits
    ``fleet.max_len``; the longest one that does not is named with its id."""
    if cfg.fleet.urls:
        return  # external servers: their own context length, which the recipe does not state
    budget = cfg.fleet.max_len - longest_generation(cfg)
    for field, problems in problem_sets:
        worst: tuple[int, str] | None = None
        for p in problems:
            n = len(render_prompt(tokenizer, p.problem, p.task, system_prompt=system_prompt))
            if n > budget and (worst is None or n > worst[0]):
                worst = (n, p.id)
        if worst is not None:
            n, pid = worst
            raise ConfigFieldError(
                "fleet.max_len",
                f"{cfg.fleet.max_len} is too short for {field}: its problem {pid!r} renders to a "
                f"{n}-token prompt, and with the {longest_generation(cfg)} tokens a completion may "
                f"take (reward.l_max) it needs {n + longest_generation(cfg)}; raise fleet.max_len or "
                "leave out the longest problems",
            )
