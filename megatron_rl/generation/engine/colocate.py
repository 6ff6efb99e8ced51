"""Colocated mode, the engine side: SGLang 0.5.23's ``/release_memory_occupation``,
``/resume_memory_occupation`` and ``/update_weights_from_tensor`` over the built-in engine, so
that a trainer and its generator can share one machine's memory (one node's GPUs with SGLang
``--enable-memory-saver``; one CPU box here) and take turns.

:class:`ColocateRoutes` is a base class of :class:`~.server.EngineServer`; its methods answer
those three routes (``POST_ROUTES``), under the server's API key like every other route.

- ``/release_memory_occupation`` ``{"tags": [...]}`` (``MEMORY_TAGS``; none or ``[]``: all).
  As SGLang, only an idle server releases: nothing running, and nothing waiting unless the
  server is paused (SGLang's ``is_fully_idle(ignore_waiting=paused)``); otherwise 400 and nothing
  changes. ``kv_cache`` frees the KV cache's key and value tensors; ``weights`` frees every
  parameter's storage; ``cuda_graph`` has nothing to free here (no CUDA graphs) and is only
  recorded. A tag already released is refused. While anything is released the engine does not
  step: a ``/generate`` that arrives is queued, as SGLang's scheduler queues it, and runs once
  everything is resumed (SGLang would run it on freed memory; we hold it instead).
- ``/resume_memory_occupation`` ``{"tags": [...]}``: allocates what those tags freed again. The
  KV cache comes back empty (nothing was running); the weights come back as zeros, as SGLang's
  come back undefined without ``--enable-weights-cpu-backup``: the next
  ``/update_weights_from_tensor`` fills them (``server_info``'s ``weights_loaded`` says whether
  every parameter has been written since). A tag that is not released is refused.
- ``/update_weights_from_tensor``: SGLang's body (``serialized_named_tensors``: one entry per
  tensor-parallel rank, base64 of ``MultiprocessingSerializer`` bytes, i.e. a ``ForkingPickler``
  pickle of a list of ``(name, tensor)``; ``load_format`` null or ``"direct"``;
  ``flush_cache``; ``abort_all_requests``; ``weight_version``). As in SGLang 0.5.23 it must run
  inside ``/begin_weight_update`` ... ``/end_weight_update``. The tensors arrive *by reference*:
  CPU tensors in POSIX shared memory named by torch (``protocol.serialize_named_tensors``), so
  the bytes never travel over HTTP. Every tensor is checked (a parameter of this model, named
  once, its shape, a floating dtype, finite in the parameter's dtype) before any is copied in;
  one bad tensor: 400 naming it, weights and version untouched. The engine copies the values
  into its own parameters: it never keeps a view of the sender's memory. A floating tensor in a
  dtype other than its parameter's is cast, as SGLang's loaders cast it, and the reply says so
  (``dtype_casts`` and the message, naming the first tensor of each pair of dtypes).

**What the unpickling does and does not protect against.** The payload is a pickle, so it is
read by an unpickler that resolves only the handful of globals a list of CPU tensors needs
(torch's ``rebuild_tensor`` / ``rebuild_typed_storage`` / ``rebuild_storage_filename``, storage
and tensor types, dtypes, ``torch.Size``), as SGLang's ``SafeUnpickler`` does, more narrowly:
no other callable can run. A tensor's extent is checked against its storage before anything
reads it (torch's rebuild does not check), and a segment must be one of torch's
(``/torch_*``) at least as large as claimed (a mapping past its end would crash the server on
the first read). It does not protect against a caller holding the API key, who can replace the
weights anyway: such a caller could make the server map another of this user's torch segments
by name. CUDA tensors (IPC handles) are refused: this engine runs on CPU.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.multiprocessing import reductions

from megatron_rl.generation.engine.engine import Engine
from megatron_rl.generation.engine.routes import ServerServices
from megatron_rl.generation.engine.weights import cast_note, checked_update, dtype_casts, version_of
from megatron_rl.generation.protocol import MEMORY_TAGS

if TYPE_CHECKING:
    from megatron_rl.fileio import JsonValue
    from megatron_rl.generation.engine.timing import TimingEngine

    Body = dict[str, JsonValue]

__all__ = ["ColocateRoutes", "TensorPayloadError", "load_named_tensors"]

# torch's shared-memory segment names (``THManagedMapAllocator``: /torch_<pid>_<random>_<n>) and
# its shm manager's socket (<tmp>/torch-shm-dir-XXXXXX/manager.sock).
_SEGMENT = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")
_MANAGER = re.compile(rb".*/torch-shm-dir-[A-Za-z0-9_]+/manager\.sock")


class TensorPayloadError(ValueError):
    """A ``serialized_named_tensors`` entry that is not a list of CPU tensors we may map."""


def _rebuild_storage_filename(
    cls: type, manager: bytes, handle: bytes, size: int, dtype: torch.dtype | None = None
) -> torch.UntypedStorage:
    """torch's ``rebuild_storage_filename``, for untyped storages in torch's own segments that
    are at least ``size`` bytes long (checked before anything is mapped)."""
    if cls is not torch.UntypedStorage or dtype is not None:
        raise TensorPayloadError("storage: only untyped CPU storages are taken")
    if not (isinstance(manager, bytes) and _MANAGER.fullmatch(manager)):
        raise TensorPayloadError(f"storage: {manager!r} is not torch's shared-memory manager")
    if not (isinstance(handle, bytes) and _SEGMENT.fullmatch(handle)):
        raise TensorPayloadError(f"storage: {handle!r} is not a torch shared-memory segment")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise TensorPayloadError(f"storage: size must be an integer >= 0, got {size!r}")
    try:
        length = os.stat(b"/dev/shm" + handle).st_size
    except OSError:
        raise TensorPayloadError(
            f"storage: segment {handle.decode()} does not exist on this host (is the sender on "
            "another machine, or did it free its tensors before the server answered?)"
        ) from None
    if length < size:
        raise TensorPayloadError(f"storage: segment {handle.decode()} holds {length} bytes, not {size}")
    storage: torch.UntypedStorage = reductions.rebuild_storage_filename(cls, manager, handle, size)
    return storage


def _rebuild_typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.TypedStorage:
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise TensorPayloadError("storage: a typed storage must wrap an untyped one with a dtype")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_tensor(cls: type, storage: torch.TypedStorage, metadata: tuple[object, ...]) -> torch.Tensor:
    """torch's ``rebuild_tensor`` once the tensor's extent is inside its storage (torch's own
    rebuild would make a view past the end, and a read of it would leak or crash)."""
    if cls not in (torch.Tensor, torch.nn.Parameter) or not isinstance(storage, torch.TypedStorage):
        raise TensorPayloadError("tensor: must be a plain tensor over a typed storage")
    try:
        offset, size, stride, _requires_grad = metadata
        dims = [int(d) for d in size]  # type: ignore[attr-defined]
        steps = [int(s) for s in stride]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise TensorPayloadError(f"tensor: bad metadata {metadata!r}") from None
    if not isinstance(offset, int) or offset < 0 or len(dims) != len(steps):
        raise TensorPayloadError(f"tensor: bad offset or layout {metadata!r}")
    if any(d < 0 for d in dims) or any(s < 0 for s in steps):
        raise TensorPayloadError(f"tensor: negative size or stride {metadata!r}")
    if all(dims):  # an empty tensor reads nothing
        last = offset + sum((d - 1) * s for d, s in zip(dims, steps))
        elements = storage._untyped_storage.nbytes() // storage.dtype.itemsize
        if last >= elements:
            raise TensorPayloadError(
                f"tensor: shape {dims} at offset {offset} reaches element {last}, past its "
                f"storage of {elements}"
            )
    return reductions.rebuild_tensor(cls, storage, (offset, torch.Size(dims), tuple(steps), False))


# The only globals a payload may name: module -> name -> what it resolves to.
_ALLOWED: dict[tuple[str, str], object] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
}
_WHY_NOT = {
    "rebuild_cuda_tensor": "a CUDA tensor (an IPC handle): the built-in engine runs on CPU",
    "rebuild_storage_fd": "a file-descriptor storage: its descriptor is passed through a socket "
    "keyed to the sender's processes; send CPU tensors by segment name "
    "(protocol.serialize_named_tensors)",
}


class _TensorUnpickler(pickle.Unpickler):
    """Resolves only ``_ALLOWED`` and torch's dtypes; any other global is refused by name."""

    def find_class(self, module: str, name: str) -> object:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        why = _WHY_NOT.get(name, "not allowed in a tensor payload")
        raise TensorPayloadError(f"{module}.{name}: {why}")


def load_named_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """One ``serialized_named_tensors`` entry (base64 of a ``ForkingPickler`` pickle of a list of
    ``(name, tensor)``) as that list; :class:`TensorPayloadError` saying what is wrong otherwise.
    The tensors are views of the sender's shared memory: copy them before it frees them."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        raise TensorPayloadError("not base64") from None
    try:
        obj = _TensorUnpickler(io.BytesIO(raw)).load()
    except TensorPayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise TensorPayloadError(f"not a tensor pickle: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(obj, list) or not obj:
        raise TensorPayloadError(f"must be a non-empty list of (name, tensor), got {type(obj).__name__}")
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(obj):
        if not (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TensorPayloadError(f"[{i}]: must be a (name, tensor) pair")
        if item[1].device.type != "cpu":
            raise TensorPayloadError(f"[{i}] {item[0]}: a {item[1].device} tensor; this engine takes CPU")
        out.append((item[0], item[1]))
    return out


@dataclass
class _Memory:
    """What a server has released, and what it must put back (touched under the engine lock)."""

    released: set[str] = field(default_factory=set)  # MEMORY_TAGS released now
    kv: tuple[torch.Size, torch.dtype, torch.device] | None = None  # the freed KV tensors' layout
    weights: dict[str, torch.Size] = field(default_factory=dict)  # freed parameters' shapes
    unloaded: set[str] = field(default_factory=set)  # resumed as zeros, not written since
    holding: bool = False  # the engine loop is held (one announced intent, see _hold)


def _tags(body: Body) -> list[str]:
    """The ``tags`` of a memory route, checked; none or ``[]``: every tag (as SGLang)."""
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list):
        raise ValueError(f"tags: must be a list of {', '.join(MEMORY_TAGS)}, got {tags!r}")
    for i, t in enumerate(tags):
        if t not in MEMORY_TAGS:
            raise ValueError(f"tags[{i}]: {t!r} is not one of {', '.join(MEMORY_TAGS)}")
    return list(dict.fromkeys(str(t) for t in tags))


def _flag(body: Body, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key}: must be true or false, got {v!r}")
    return v


class ColocateRoutes(ServerServices):
    """The colocated-mode routes of :class:`~.server.EngineServer` (see the module docstring).

    The server provides what is declared here: its engine, the engine lock (``cond``, taken
    through ``_between_steps``), the announced-intents counter the engine loop waits on, the
    weight-update session flag, its stats, ``_abort_all`` and ``_route_error`` (its 4xx error:
    ``_route_error(message, status)``)."""

    engine: Engine | TimingEngine
    cond: threading.Condition
    stats: dict[str, float]
    _session: bool
    _intents: int
    _intents_lock: threading.Lock
    _route_error: ClassVar[type[Exception]]

    # ------------------------------------------------------------------ state

    def _memory(self) -> _Memory:
        """This server's memory state (created on first use; callers hold the engine lock)."""
        state: _Memory | None = self.__dict__.get("_memory_state")
        if state is None:
            state = self.__dict__["_memory_state"] = _Memory()
        return state

    def _refuse(self, message: str, status: int = 400) -> Exception:
        """The server's error answering ``status`` with ``message`` (to raise)."""
        return self._route_error(message, status)

    def _model_engine(self, route: str) -> Engine:
        """The engine, if it holds a model (the timing engine has no memory to release)."""
        if not isinstance(self.engine, Engine):
            raise self._refuse(f"{route}: the timing engine holds no KV cache or weights")
        return self.engine

    def _hold(self, on: bool) -> None:
        """Keep the engine loop from stepping (``on``) or let it go: one announced intent, which
        the loop waits on as it waits on a handler about to take the lock (callers hold it)."""
        state = self._memory()
        if on == state.holding:
            return
        with self._intents_lock:
            self._intents += 1 if on else -1
        state.holding = on

    def memory_state(self) -> dict[str, JsonValue]:
        """What ``/server_info`` reports (the caller holds the engine lock): the released tags,
        and whether every weight has been written since a resume."""
        state = self._memory()
        return {"memory_released": sorted(state.released), "weights_loaded": not state.unloaded}

    # ------------------------------------------------------------------ routes

    def release_memory(self, body: Body) -> Body:
        """``/release_memory_occupation``: free the tagged memory of an idle server."""
        try:
            tags = _tags(body)
        except ValueError as e:
            raise self._refuse(str(e)) from None
        with self._between_steps():
            engine, state = self._model_engine("/release_memory_occupation"), self._memory()
            again = [t for t in tags if t in state.released]
            if again:
                raise self._refuse(f"tags: {again[0]!r} is already released")
            if engine.running or (engine.waiting and not engine.paused):
                raise self._refuse(
                    "release_memory_occupation should be called only when server is idle "
                    f"({engine.running} running, {engine.waiting} waiting; requests may wait "
                    "only while the server is paused)"
                )
            if "kv_cache" in tags:
                k = engine.cache.k
                state.kv = (k.shape, k.dtype, k.device)
                engine.cache.k = torch.empty(0, dtype=k.dtype, device=k.device)
                engine.cache.v = torch.empty(0, dtype=k.dtype, device=k.device)
            if "weights" in tags:
                for n, p in engine.model.named_weights().items():
                    state.weights[n] = p.shape
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            state.released.update(tags)
            self._hold(True)
        return {"success": True, "message": f"released {', '.join(tags)}"}

    def resume_memory(self, body: Body) -> Body:
        """``/resume_memory_occupation``: allocate the tagged memory again (weights as zeros
        until the next update); the engine steps again once nothing is released."""
        try:
            tags = _tags(body)
        except ValueError as e:
            raise self._refuse(str(e)) from None
        with self._between_steps():
            engine, state = self._model_engine("/resume_memory_occupation"), self._memory()
            missing = [t for t in tags if t not in state.released]
            if missing:
                raise self._refuse(f"tags: {missing[0]!r} is not released")
            if "kv_cache" in tags and state.kv is not None:
                shape, dtype, device = state.kv
                engine.cache.k = torch.zeros(shape, dtype=dtype, device=device)
                engine.cache.v = torch.zeros(shape, dtype=dtype, device=device)
                engine.cache.lengths.zero_()
                state.kv = None
            if "weights" in tags:
                for n, p in engine.model.named_weights().items():
                    p.data = torch.zeros(state.weights.pop(n, p.shape), dtype=p.dtype, device=p.device)
                    state.unloaded.add(n)
            state.released.difference_update(tags)
            if not state.released:
                self._hold(False)
        return {"success": True, "message": f"resumed {', '.join(tags)}"}

    def update_weights_from_tensor(self, body: Body) -> Body:
        """``/update_weights_from_tensor``: every tensor of the payload checked, then all copied
        into the parameters between steps (and the version set), or none."""
        route = "/update_weights_from_tensor"
        try:
            entry, version, abort_all = _tensor_update_spec(body)
        except ValueError as e:
            raise self._refuse(str(e)) from None
        with self._between_steps():
            self._check_loadable(route)
        try:
            received = load_named_tensors(entry)
        except TensorPayloadError as e:
            raise self._refuse(f"serialized_named_tensors[0]: {e}; nothing was applied") from None
        with self._between_steps():
            engine = self._check_loadable(route)
            params = engine.model.named_weights()
            tensors, errors = checked_update(received, params)
            if errors:
                more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
                raise self._refuse(f"{errors[0]}{more}; nothing was applied")
            casts = dtype_casts(((n, t.dtype) for n, t in received), params)
            if abort_all:
                self._abort_all()
            with torch.no_grad():
                for n, t in tensors:
                    params[n].copy_(t)  # a copy: the sender frees its shared memory after this
            self._memory().unloaded.difference_update(n for n, _ in tensors)
            engine.weights_changed(version)
            self.stats["weight_updates"] += 1
        note = f" Weight version updated to {version}." if version is not None else ""
        return {
            "success": True,
            "message": f"Success{note}{cast_note(casts)}",
            "dtype_casts": {pair: len(names) for pair, names in casts.items()},
        }

    def _check_loadable(self, route: str) -> Engine:
        """The engine, if weights can be loaded now (a session open, the weights not released)."""
        engine = self._model_engine(route)
        if not self._session:
            raise self._refuse(
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        if "weights" in self._memory().released:
            raise self._refuse(f"{route}: the weights are released; resume them (tags: [weights]) first")
        return engine


def _tensor_update_spec(body: Body) -> tuple[str, int | None, bool]:
    """``(entry, weight_version, abort_all_requests)`` of an ``/update_weights_from_tensor``
    body, checked (``ValueError`` naming the field)."""
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or not entries:
        raise ValueError("serialized_named_tensors: required, one base64 string per tensor-parallel rank")
    if len(entries) != 1:
        raise ValueError(
            f"serialized_named_tensors: this server has 1 tensor-parallel rank, got {len(entries)} entries"
        )
    if not isinstance(entries[0], str):
        raise ValueError("serialized_named_tensors[0]: must be a base64 string")
    load_format = body.get("load_format")
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format: {load_format!r} is not supported (null or direct)")
    selector = body.get("selector", "all")
    if selector not in (None, "all", "target"):
        raise ValueError(f"selector: {selector!r}: this server has no draft model (all or target)")
    _flag(body, "flush_cache", True)  # no prefix cache to flush
    _flag(body, "torch_empty_cache", False)
    abort_all = _flag(body, "abort_all_requests", False)
    v = body.get("weight_version")
    version = None if v is None else version_of(v)  # a ManifestError is a ValueError: 400
    return entries[0], version, abort_all
