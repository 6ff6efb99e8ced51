"""k completions per problem through any :class:`~megatron_rl.generation.api.Generator`, scored by
the real reward: the shared first half of difficulty filtering and evaluation.

Prompts are the training prompts: :func:`megatron_rl.rewards.template.build_messages` (Magistral's
system prompt plus the task instruction) rendered by the tokenizer's chat template, or as plain
text when it has none (:func:`render_prompt`). Completions are
scored as they come back from the generator, in a :class:`VerifierPool`, so verification overlaps
generation. Every request carries a seed derived from ``(seed, problem id, sample index)``: the
same call on the same generator samples the same completions.

    gen = open_generator(model="ckpt/")                  # or servers=["http://h:30000"]
    attempts = sample_and_score(problems, gen, tokenizer, SamplingConfig(k=16), RewardConfig())
    attempts["p1"][0].correct, attempts["p1"][0].answer  # per problem, in sample order
"""

from __future__ import annotations

import functools
import os
import queue
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from megatron_rl.config import check_range
from megatron_rl.data.problems import Problem, check_scorable, reward_input
from megatron_rl.environments.calls import EnvCalls, load_environment
from megatron_rl.environments.trajectory import TrajectoryRun, run_trajectories
from megatron_rl.errors import InputError, UsageError
from megatron_rl.generation.api import GenRequest, GenResult, LocalGenerator
from megatron_rl.generation.client import FleetClient
from megatron_rl.rewards.code import ensure_pch
from megatron_rl.rewards.compose import RewardConfig, hard_timeout_s, score, verifier_warmup
from megatron_rl.rewards.format import check_format, last_boxed
from megatron_rl.rewards.pool import PoolTaskError, VerifierPool
from megatron_rl.rewards.template import (
    DEFAULT_THINK_TAGS,
    SYSTEM_PROMPT,
    build_messages,
    render_messages,
)

if TYPE_CHECKING:
    from megatron_rl.environments.config import EnvConfig
    from megatron_rl.fileio import JsonValue
    from megatron_rl.rewards.result import RewardResult

__all__ = [
    "Attempt",
    "SamplingConfig",
    "byte_level_table",
    "check_think_tags_in",
    "close_generator",
    "decode_completion",
    "extract_answer",
    "load_tokenizer",
    "open_generator",
    "render_prompt",
    "sample_and_score",
    "sequence_budget",
    "stop_token_ids",
]


@dataclass(kw_only=True)
class SamplingConfig:
    """How completions are sampled."""

    k: int = 16  # completions per problem
    max_new_tokens: int = 4096  # completion budget per sample
    temperature: float = 1.0  # 0: greedy (then all k samples are equal)
    top_p: float = 1.0
    seed: int = 0  # base of the per-request seeds
    system_prompt: str = SYSTEM_PROMPT  # the training prompt's; "" for none
    # a multi-turn environment (the run's env section): each sample a trajectory; None: single-turn
    env: EnvConfig | None = None

    def __post_init__(self) -> None:
        check_range("k", self.k, low=1)
        check_range("max_new_tokens", self.max_new_tokens, low=1)
        check_range("temperature", self.temperature, low=0.0)
        check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True)


@dataclass(kw_only=True)
class Attempt:
    """One sampled and scored completion."""

    index: int  # sample index within the problem, 0..k-1
    completion: str
    num_tokens: int
    finish_reason: str  # stop / length / abort
    reward: float
    reason: str  # one of megatron_rl.rewards.result.REASONS
    correct: bool
    answer: str | None = None  # math: last \boxed{} of the answer part (None: format failed)
    parts: dict[str, float] | None = None
    prompt_ids: list[int] | None = None  # kept only when asked (keep_tokens=True)
    completion_ids: list[int] | None = None

    def to_json(self) -> dict[str, JsonValue]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def extract_answer(
    completion: str, task: str, think_tags: tuple[str, str] | list[str] = DEFAULT_THINK_TAGS
) -> str | None:
    """The final answer a math completion gives (last ``\\boxed{}`` of the answer part), or None
    when the format check fails; always None for code (programs are not voted on)."""
    if task != "math":
        return None
    parsed, _ = check_format(completion, "math", think_tags)
    return None if parsed is None else last_boxed(parsed.answer)


def check_think_tags_in(tokenizer, think_tags: Sequence[str], *, name: str = "") -> None:
    """``reward.think_tags`` against the run's tokenizer: a pair other than the default must be one
    token each (Magistral 1.2's tekken holds ``[THINK]`` and ``[/THINK]`` as special tokens: a
    model of another tokenizer never wrote them as one and would learn them from nothing); the
    default ``<think>``/``</think>`` may be written in pieces (Llama 3's are). Raises
    :class:`~megatron_rl.errors.UsageError` naming the field, the tag and the tokenizer."""
    if tuple(think_tags) == DEFAULT_THINK_TAGS:
        return
    for tag in think_tags:
        tid = tokenizer.convert_tokens_to_ids(tag)
        if (
            isinstance(tid, int)
            and tid != tokenizer.unk_token_id
            and tokenizer.convert_ids_to_tokens(tid) == tag
        ):
            continue
        pieces = tokenizer.tokenize(tag)
        raise UsageError(
            f"reward.think_tags: {tag!r} is not one token of the tokenizer"
            f"{' at ' + name if name else ''} (it is {len(pieces)} pieces: {pieces[:8]}); Magistral "
            f"1.2's tokenizer holds [THINK] and [/THINK] as special tokens; for a tokenizer "
            f"without the tags keep the default {list(DEFAULT_THINK_TAGS)}, or add them to it"
        )


def render_prompt(tokenizer, problem: str, task: str, *, system_prompt: str = SYSTEM_PROMPT) -> list[int]:
    """Token ids of the training prompt for ``problem``: system prompt + problem + instruction,
    rendered by :func:`~megatron_rl.rewards.template.render_messages` (the chat template with the
    generation prompt appended; a template that refuses a system role gets the system prompt at
    the head of the user message; without a template, plain text with the tokenizer's BOS). No
    system message when ``system_prompt`` is ""."""
    messages = build_messages(problem, task, system_prompt=system_prompt)
    if not system_prompt:
        messages = messages[1:]
    return render_messages(tokenizer, messages)


def sequence_budget(cfg: SamplingConfig, longest_prompt: int) -> int:
    """The engine's ``max_len`` for sampling with ``cfg``: the longest rendered prompt and the
    completion budget; with an environment, its whole trajectory (``env.max_tokens``) and room
    for what its ``reset`` adds to the problem's prompt (the Python tool's instructions: ~60
    tokens; 256 kept)."""
    if cfg.env is not None and cfg.env.enabled:
        return longest_prompt + max(cfg.max_new_tokens, cfg.env.max_tokens) + 256
    return longest_prompt + cfg.max_new_tokens


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's EOS as a stop token (the engine also stops at the model config's EOS)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def decode_completion(tokenizer, token_ids) -> str:
    """The completion's text as the verifiers read it: every token kept (a model's ``<think>``
    may be a special token), except a final EOS, which ends the turn and is not text."""
    return completion_decoder(tokenizer, table=False)(token_ids)


def completion_decoder(tokenizer, *, table: bool = True) -> Callable[[Sequence[int]], str]:
    """:func:`decode_completion` for ``tokenizer``, with what it needs looked up once: the RL
    loop decodes every completion of a run with it (a tenth of the orchestrator's CPU).

    ``table``: where the tokenizer decodes byte-level (:func:`byte_level_table`: Llama 3, Qwen,
    Mistral's Tekken, the quickstart's), a completion is its tokens' bytes joined and read as
    UTF-8, three times faster than the Rust decoder called from Python (3.5 against 11 us for
    105 tokens); the table is checked against the tokenizer's own decode when it is built."""
    eos = getattr(tokenizer, "eos_token_id", None)
    # A fast (Rust) tokenizer without the clean-up pass decodes exactly what its own decode()
    # returns; called directly it skips transformers' per-token conversion of the id list
    # (to_py_obj) and attribute look-ups, half of a decode.
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    decode = backend.decode if fast and backend is not None else tokenizer.decode
    pieces = byte_level_table(backend) if table and fast else None
    if pieces is not None:
        piece, rust = pieces.__getitem__, decode

        def joined(ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            # An id past the vocabulary or below 0 (a server's bug): the tokenizer's own answer.
            if not ids or min(ids) >= 0:
                try:
                    return b"".join(map(piece, ids)).decode("utf-8", "replace")
                except (IndexError, TypeError):
                    pass
            return rust(list(ids), skip_special_tokens=skip_special_tokens)

        decode = joined

    def run(token_ids: Sequence[int]) -> str:
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if ids and eos is not None and ids[-1] == eos:
            ids = ids[:-1]
        return decode(ids, skip_special_tokens=False)

    return run


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte (``bytes_to_unicode`` inverted): printable
    bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [
        *range(0x21, 0x7E + 1),
        *range(0xA1, 0xAC + 1),
        *range(0xAE, 0x100),
    ]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


def byte_level_table(backend) -> list[bytes] | None:
    """Each token id's bytes, where ``backend`` (a ``tokenizers.Tokenizer``) decodes byte-level,
    as the Rust ``ByteLevel`` decoder reads a token: its characters through GPT-2's alphabet, or
    its UTF-8 when one is outside it (an added token with a space). None for any other decoder,
    and None unless the table decodes every single id and 256 random sequences exactly as
    ``backend.decode`` does (invalid UTF-8 included: both replace it with U+FFFD)."""
    try:
        from tokenizers import decoders  # lazy: transformers' dependency, only a table needs it
    except ImportError:
        return None
    if backend is None or not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        return None
    alphabet = _byte_alphabet()
    size = backend.get_vocab_size(with_added_tokens=True)
    pieces = []
    for i in range(size):
        token = backend.id_to_token(i)
        if token is None:  # a hole in the ids: the Rust decoder skips it, so does the table
            pieces.append(b"")
        elif all(c in alphabet for c in token):
            pieces.append(bytes(alphabet[c] for c in token))
        else:
            pieces.append(token.encode())
    rng = random.Random(0)
    checks = [[i] for i in range(size)] + [
        [rng.randrange(size) for _ in range(rng.randrange(2, 40))] for _ in range(256)
    ]
    # One call for all of them (the Rust side decodes the batch in parallel): a 131k vocabulary
    # costs start-up a fraction of a second, not 131k calls from Python.
    want = backend.decode_batch(checks, skip_special_tokens=False)
    for ids, text in zip(checks, want):
        if b"".join(pieces[i] for i in ids).decode("utf-8", "replace") != text:
            return None
    return pieces


# Files a tokenizer folder has one of (fast, SentencePiece, byte-level BPE, WordPiece, tiktoken).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def load_tokenizer(folder: str, *, chat_template: str = "auto"):
    """A local Hugging Face tokenizer (no downloads). ``chat_template``: "auto" keeps the
    folder's template (prompts go through it when there is one); "none" drops it, so that
    :func:`render_prompt` renders plain text."""
    from transformers import (
        AutoTokenizer,  # lazy: transformers takes seconds to import; only this path needs it
    )

    if chat_template not in ("auto", "none"):
        raise UsageError(f"chat_template: must be 'auto' or 'none', got {chat_template!r}")
    if not os.path.isdir(folder):
        raise InputError(f"{folder}: no such tokenizer folder (a local Hugging Face folder is needed)")
    names = os.listdir(folder)
    if not any(n in _TOKENIZER_FILES or n.endswith((".tiktoken", ".model")) for n in names):
        # transformers would go on to say "install sentencepiece or tiktoken", which is not why.
        raise InputError(
            f"{folder}: not a Hugging Face tokenizer folder: it holds no tokenizer files (one of "
            f"{', '.join(_TOKENIZER_FILES)} is needed; copy them from the model's original folder)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        ImportError,
    ) as e:  # transformers' words are about hub ids
        raise InputError(
            f"{folder}: not a Hugging Face tokenizer folder (tokenizer.json or tokenizer_config.json "
            f"with its vocabulary is needed): {type(e).__name__}"
        ) from None
    if chat_template == "none":
        tokenizer.chat_template = None
    return tokenizer


def open_generator(
    *,
    model: str | None = None,
    servers: Sequence[str] | None = None,
    max_len: int = 8192,
    max_slots: int = 16,
    eos_token_ids: Iterable[int] | None = None,
) -> LocalGenerator | FleetClient:
    """A :class:`LocalGenerator` over the HF folder ``model``, or a fleet client over ``servers``."""
    if (model is None) == (not servers):
        raise ValueError("give exactly one of a model folder (--model) or server URLs (--servers)")
    if model is not None:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"{model}: not a Hugging Face model folder (no config.json)")
        return LocalGenerator.from_pretrained(
            model, max_slots=max_slots, max_len=max_len, eos_token_ids=eos_token_ids
        )
    if servers is None:  # not reached: exactly one of the two was checked to be given
        raise ValueError("give exactly one of a model folder (--model) or server URLs (--servers)")
    return FleetClient(list(servers))


def close_generator(generator) -> None:
    """Release what a generator holds (the fleet client's connections); a no-op otherwise."""
    close = getattr(generator, "close", None)
    if callable(close):
        close()


def _until(generator, results: Iterator[GenResult], deadline: float) -> Iterator[GenResult]:
    """``results`` as they come, until ``deadline`` (``time.monotonic()``): then the generator's
    requests are aborted (a fleet's ``abort``) and the iteration ends. The generator is read in a
    thread of its own, so that a deadline falls between two results too."""
    box: queue.Queue[tuple[str, object]] = queue.Queue()

    def pump() -> None:
        try:
            for res in results:
                box.put(("result", res))
        except BaseException as e:  # noqa: BLE001 -- handed to the reader, raised there
            box.put(("error", e))
        box.put(("end", None))

    threading.Thread(target=pump, name="sampling-generate", daemon=True).start()
    while True:
        try:
            kind, item = box.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            abort = getattr(generator, "abort", None)
            if callable(abort):
                abort()  # every request still running comes back at once, as aborted
            return
        if kind == "end":
            return
        if kind == "error" and isinstance(item, BaseException):
            raise item
        yield item  # type: ignore[misc]  # kind == "result": a GenResult


Sampled = tuple[int, int, GenResult, str, dict[str, float]]  # problem, sample, result, text, env terms


def _single_turn_samples(
    problems: Sequence[Problem], generator, tokenizer, cfg: SamplingConfig, deadline: float | None
) -> Iterator[Sampled]:
    """Each problem's ``cfg.k`` completions as they finish (none past ``deadline``)."""
    prompts = [render_prompt(tokenizer, p.problem, p.task, system_prompt=cfg.system_prompt) for p in problems]
    stops = stop_token_ids(tokenizer)

    def requests():
        for i, p in enumerate(problems):
            for j in range(cfg.k):
                yield GenRequest(
                    request_id=f"{i}/{j}",
                    input_ids=prompts[i],
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    stop_token_ids=stops,
                    seed=zlib.crc32(f"{cfg.seed}:{p.id}:{j}".encode()),
                )

    if deadline is not None and time.monotonic() >= deadline:
        return  # past its deadline: nothing to do
    results = generator.generate(requests())
    for res in results if deadline is None else _until(generator, results, deadline):
        if res.finish_reason == "abort" and deadline is not None and time.monotonic() >= deadline:
            continue  # cut by the deadline: not a sample
        i, j = (int(x) for x in res.request_id.split("/"))
        yield i, j, res, decode_completion(tokenizer, res.token_ids), {}


def _trajectory_samples(
    problems: Sequence[Problem],
    generator,
    tokenizer,
    cfg: SamplingConfig,
    env: EnvConfig,
    deadline: float | None,
) -> Iterator[Sampled]:
    """Each problem's ``cfg.k`` trajectories with the environment ``env``, run turn by turn
    (a turn that would start past ``deadline`` is not sent: the trajectory ends there)."""
    assert env.custom is not None
    make = functools.partial(load_environment(env.custom), **env.options)
    calls = EnvCalls(env.step_timeout_s)
    stops = stop_token_ids(tokenizer)
    decode = completion_decoder(tokenizer)
    keys = [(i, j) for i in range(len(problems)) for j in range(cfg.k)]
    runs = [
        TrajectoryRun(
            make,
            problems[i].to_json(),
            calls=calls,
            tokenizer=tokenizer,
            cfg=env,
            stop_ids=stops,
            decode=decode,
        )
        for i, _ in keys
    ]
    turn = [0] * len(keys)

    def generate(turns: list[tuple[int, list[int], int]]) -> Iterator[tuple[int, GenResult]]:
        if deadline is not None and time.monotonic() >= deadline:
            for k, _, _ in turns:
                runs[k].trajectory.end = "time_limit"
            return
        reqs = []
        for k, ids, max_new in turns:
            i, j = keys[k]
            reqs.append(
                GenRequest(
                    request_id=str(k),
                    input_ids=ids,
                    max_new_tokens=max_new,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    stop_token_ids=stops,
                    seed=zlib.crc32(f"{cfg.seed}:{problems[i].id}:{j}:{turn[k]}".encode()),
                )
            )
            turn[k] += 1
        for res in generator.generate(reqs):
            yield int(res.request_id), res

    try:
        trajectories = run_trajectories(runs, generate)
    finally:
        calls.close()
    for (i, j), t in zip(keys, trajectories):
        res = GenResult.of_trajectory(f"{i}/{j}", t)
        yield i, j, res, t.final_text, t.terms


def sample_and_score(
    problems: Sequence[Problem],
    generator,
    tokenizer,
    cfg: SamplingConfig,
    reward_cfg: RewardConfig,
    *,
    pool: VerifierPool | None = None,
    progress: bool = True,
    keep_tokens: bool = False,
    desc: str = "sampling",
    deadline: float | None = None,
) -> dict[str, list[Attempt]]:
    """``cfg.k`` completions of every problem, scored; ``{problem id: [Attempt] in sample order}``.

    A verifier that fails (hard time-out, crash) scores its sample 0 with that reason, as in
    training, and so does one whose score is not in by the pool's deadline (everything queued
    ahead of it, each task within its hard limit: ``scoring_timeout``): this never waits without
    end. ``deadline`` (``time.monotonic()``, e.g. the run's time limit) cuts the whole call short:
    generation stops there (the samples not generated by then have no attempt: a caller counts
    them as ``k * len(problems)`` minus the attempts), and samples not scored by then score 0 with
    reason ``time_limit``. ``pool`` is reused when given, else one of ``reward_cfg.workers`` is
    started. :class:`~megatron_rl.rewards.pool.PoolBroken` when no verifier can start.

    ``cfg.env`` (``env.custom`` set): every sample is a trajectory with its environment, as in
    training (:func:`~megatron_rl.environments.trajectory.run_trajectories`, turn by turn); the
    last model turn is scored, with the trajectory's model tokens as its length and the
    environment's terms added (``env/<name>`` parts), and ``completion_ids`` holds the whole
    trajectory.
    """

    for p in problems:
        check_scorable(p, needs_reference=not reward_cfg.replaces_correctness)
    if any(p.task == "code" and p.language in (None, "cpp") for p in problems):
        ensure_pch(reward_cfg.code)  # once, outside the per-sample hard time limits
    if cfg.env is not None and cfg.env.enabled:
        samples = _trajectory_samples(problems, generator, tokenizer, cfg, cfg.env, deadline)
    else:
        samples = _single_turn_samples(problems, generator, tokenizer, cfg, deadline)
    own = pool is None
    pool = pool or VerifierPool(reward_cfg.workers, warmup=verifier_warmup(reward_cfg))
    pending: list[tuple[int, int, GenResult, str, Future[RewardResult]]] = []
    bar = tqdm(total=len(problems) * cfg.k, desc=desc, unit="sample", file=sys.stderr, disable=not progress)
    terms: dict[tuple[int, int], dict[str, float]] = {}
    try:
        for i, j, res, text, env_terms in samples:
            if env_terms:
                terms[(i, j)] = env_terms
            inp = reward_input(problems[i], text, num_tokens=res.model_tokens)
            future = pool.submit(score, inp, reward_cfg, timeout_s=hard_timeout_s(inp, reward_cfg))
            pending.append((i, j, res, text, future))
            bar.update(1)
        out: dict[str, list[Attempt]] = {p.id: [] for p in problems}
        by = pool.deadline()  # every sample scored by then, unless the pool is wedged
        cut = deadline is not None and deadline < by  # the caller's deadline comes first
        until = min(by, deadline) if deadline is not None else by
        for i, j, res, text, future in sorted(pending, key=lambda t: (t[0], t[1])):
            p = problems[i]
            try:
                r = pool.result(future, until, reason="time_limit" if cut else "scoring_timeout")
                reward, reason, correct, parts = r.reward, r.reason, r.correct, r.parts
            except PoolTaskError as e:
                reward, reason, correct, parts = 0.0, e.reason, False, {}
            if (i, j) in terms:  # the environment's own reward terms, as in training
                reward += sum(terms[(i, j)].values())
                parts = {**parts, **{f"env/{k}": v for k, v in terms[(i, j)].items()}}
            out[p.id].append(
                Attempt(
                    index=j,
                    completion=text,
                    num_tokens=res.model_tokens,
                    finish_reason=res.finish_reason,
                    reward=reward,
                    reason=reason,
                    correct=correct,
                    answer=extract_answer(text, p.task, reward_cfg.think_tags),
                    parts=parts,
                    prompt_ids=list(res.prompt_ids) if keep_tokens else None,
                    completion_ids=list(res.token_ids) if keep_tokens else None,
                )
            )
        return out
    finally:
        bar.close()
        if own:
            pool.close(cancel=True)  # every result is in (or its deadline passed): nothing to finish
