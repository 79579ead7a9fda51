"""The program registry: every device program kind is declared once, where the code that owns it
lives, and registers itself; a runner asks `programs.get(kind, key)` and never names a kind's
signature itself.

A `ProgramKind` says, for a runner (its `ctx`) and a key (a bucket, a stage, a variant):
  signature(ctx, key) -> Signature   the jitted fn (donation and shardings are part of it and of
                                     its abstract arguments) and the devices it runs on, in order
  keys(ctx) -> list                  every key this runner needs compiled before serving
  owned(ctx, key) -> bool            whether this process compiles and runs it (stages over
                                     processes: a stage's programs live in its own process)
  family                             which owner's programs it is ("model_runner"): a `Programs`
                                     takes every kind of its family, so a new kind is one
                                     registration in a module its owner imports

`Programs.get` compiles on demand (through jvllm's executable cache where it is on: keyed by the
program's fingerprint, so a warm start neither traces nor lowers; see `fingerprint`) and is
thread-safe: one lock per key, so two threads asking for one key compile it once and a thread
asking for another key does not wait. `warm_up(keys, background=True)` compiles a list in daemon
threads (`compile_threads()`) and returns a `WarmUp` handle (`wait()`, `done()`); serving meanwhile compiles what it needs
first on demand (or waits for the key the warm-up thread is compiling).

Hazards: every process of a multi-process run must compile the same programs (on GPUs XLA shares
autotuning between them); callers warm up in the foreground there. A process must not exit while
the warm-up thread is inside XLA (the runtime aborts): an atexit hook cancels every warm-up still
running and waits for the program it is compiling.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import weakref
from typing import Any, Callable

from jvllm.compilation import executable_cache
from jvllm.compilation import fingerprint as fingerprints
from jvllm.compilation.counter import compile_count, temp_bytes


@dataclasses.dataclass(frozen=True)
class Signature:
    fn: Any                    # a jax.jit'ed callable (donation declared on it)
    args: tuple                # abstract arguments (ShapeDtypeStruct trees carrying shardings)
    devices: tuple             # the devices the executable runs on, in its order
    kwargs: dict = dataclasses.field(default_factory=dict)  # static keyword arguments


@dataclasses.dataclass(frozen=True)
class ProgramKind:
    name: str
    signature: Callable[[Any, Any], Signature]
    keys: Callable[[Any], list]
    owned: Callable[[Any, Any], bool] = lambda ctx, key: True
    family: str = "model_runner"


KINDS: dict[str, ProgramKind] = {}


def register(kind: ProgramKind) -> ProgramKind:
    """Declare a program kind (once per name; a second declaration of a name is an error)."""
    if kind.name in KINDS and KINDS[kind.name] is not kind:
        raise ValueError(f"program kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def kind(name: str) -> ProgramKind:
    try:
        return KINDS[name]
    except KeyError:
        raise KeyError(f"unknown program kind {name!r}; registered: {sorted(KINDS)}") from None


class WarmUp:
    """A warm-up in progress (or done): `wait()` blocks until every program is compiled and re-raises
    the first error; `done()` does not block. `seconds` and `compile_count_at_end` are set at the end."""

    def __init__(self):
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self.compile_count_at_end: int | None = None
        self.cancelled = False

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> "WarmUp":
        if not self._event.wait(timeout):
            raise TimeoutError(f"warm-up not done after {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def cancel(self):
        """Stop after the program being compiled now (shutdown)."""
        self.cancelled = True

    def _finish(self, t0: float):
        self.seconds = time.perf_counter() - t0
        self.compile_count_at_end = planned_compile_count()
        self._event.set()


_running: "weakref.WeakSet[WarmUp]" = weakref.WeakSet()
_lowered = [0]  # programs this process traced and lowered through a `Programs` (lowering_count)
_lowered_lock = threading.Lock()


_deferred_total = [0]  # XLA compiles of deferred programs on their first use, every `Programs` of the process
_deferred_lock = threading.Lock()


def planned_compile_count() -> int:
    """`compile_count()` less the compiles of deferred programs (`Programs.defer`): process-wide,
    as the counter is, so "compiles after warm-up" counted with it means compiles outside every
    engine's plan."""
    with _deferred_lock:
        return compile_count() - _deferred_total[0]


def lowering_count() -> int:
    """How many programs this process has traced and lowered through a `Programs` (a warm start
    with jvllm's executable cache lowers none: tests and benchmarks read it)."""
    return _lowered[0]


@atexit.register
def _stop_warmups():
    for h in list(_running):
        h.cancel()
    for h in list(_running):
        h._event.wait(120)


def compile_threads() -> int:
    """Threads a background warm-up compiles with: `JVLLM_COMPILE_THREADS` if set (>= 1), else a
    quarter of the host's cores, 1 to 4 (XLA's compile is mostly single-threaded C++ that releases
    the GIL; the serving loop keeps the other cores)."""
    v = os.environ.get("JVLLM_COMPILE_THREADS")
    if v is not None:
        try:
            n = int(v)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"JVLLM_COMPILE_THREADS must be an integer >= 1, got {v!r}")
        return n
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _lower(sig: Signature):
    lowered = sig.fn.lower(*sig.args, **sig.kwargs)
    with _lowered_lock:
        _lowered[0] += 1
    return lowered


class Programs:
    """The compiled programs of one owner (`ctx`), by (kind, key): every registered kind of `family`."""

    def __init__(self, ctx, family: str = "model_runner"):
        self.ctx = ctx
        self.kinds = tuple(n for n, k in KINDS.items() if k.family == family)
        if not self.kinds:
            raise KeyError(f"no program kind of family {family!r} is registered; families: "
                           f"{sorted({k.family for k in KINDS.values()})}")
        self._compiled: dict = {}
        self._described: dict = {}  # id(jitted fn) -> (fn, its description): fingerprints.fingerprint's memo
        self._locks: dict = {}
        self._lock = threading.Lock()
        self._deferred: set = set()  # planned (kind, key)s left to their first use (`defer`)
        self.deferred_compiles = 0   # XLA compiles those first uses made

    def defer(self, keys: list[tuple]):
        """Mark planned programs that the warm-up leaves to their first use (EngineConfig.warmup
        "first"): the XLA compiles `get` then makes for them are counted in `deferred_compiles`, so
        a caller can tell them from compiles outside the plan (a stray program: a bug); the
        process-wide `planned_compile_count()` leaves them out."""
        self._deferred.update(keys)

    def keys(self) -> list[tuple]:
        """Every (kind, key) this process compiles before serving, kind by kind."""
        out = []
        for n in self.kinds:
            k = KINDS[n]
            out += [(n, key) for key in k.keys(self.ctx) if k.owned(self.ctx, key)]
        return out

    def get(self, name: str, key):
        """The executable of (name, key), compiled now if it is not yet."""
        exe = self._compiled.get((name, key))
        if exe is not None:
            return exe
        with self._lock:
            lock = self._locks.setdefault((name, key), threading.Lock())
        with lock:
            exe = self._compiled.get((name, key))
            if exe is None:
                deferred = (name, key) in self._deferred
                c0 = compile_count() if deferred else 0
                exe = self._compile(name, key)
                self._compiled[(name, key)] = exe
                if deferred:
                    n = compile_count() - c0
                    with self._lock:
                        self.deferred_compiles += n
                    with _deferred_lock:
                        _deferred_total[0] += n
        return exe

    def lower(self, name: str, key):
        """(lowered module, devices) of (name, key), without compiling."""
        sig = kind(name).signature(self.ctx, key)
        return _lower(sig), sig.devices

    def cache_key(self, name: str, key) -> str:
        """jvllm's lowered-module executable-cache key of (name, key) (`executable_cache.executable_key`)."""
        return executable_cache.executable_key(*self.lower(name, key))

    def fingerprint(self, name: str, key) -> str | None:
        """The traceless cache key of (name, key) (`compilation.fingerprint`), or None when some part
        of its signature has no exact description (it is then keyed by its lowered module)."""
        return self._fingerprint(name, key, kind(name).signature(self.ctx, key))

    def _fingerprint(self, name: str, key, sig) -> str | None:
        try:
            return fingerprints.fingerprint(name, key, sig, self._described)
        except fingerprints.Unfingerprintable:
            return None

    def temp_bytes(self, name: str, key) -> int | None:
        """XLA's temp allocation of (name, key): read from jvllm's executable cache without loading
        or tracing anything when its entry is there, else from the program compiled now."""
        if executable_cache.enabled():
            fp = self.fingerprint(name, key)
            meta = executable_cache.load_meta(fp) if fp is not None else None
            if meta is not None and "temp_size_in_bytes" in meta:
                return meta["temp_size_in_bytes"]
        return temp_bytes(self.get(name, key))

    def _compile(self, name: str, key):
        """Load (name, key) from jvllm's executable cache, keyed by its fingerprint (no trace) or,
        where it has none, by its lowered module; else lower, compile and store it."""
        sig = kind(name).signature(self.ctx, key)
        ck = None
        if executable_cache.enabled():
            ck = self._fingerprint(name, key, sig)
            exe = executable_cache.load(ck, sig.devices) if ck is not None else None
            if exe is not None:
                return exe
        lowered = _lower(sig)
        if executable_cache.enabled() and ck is None:
            ck = executable_cache.executable_key(lowered, sig.devices)
            exe = executable_cache.load(ck, sig.devices)
            if exe is not None:
                return exe
        if ck is None:
            return lowered.compile()
        exe, storable = executable_cache.compile_for_cache(lowered, sig.devices)
        if storable:
            executable_cache.store(ck, exe)
        return exe

    def compiled(self) -> dict:
        """A snapshot {(kind, key): executable} of what is compiled so far."""
        return dict(self._compiled)

    def warm_up(self, keys: list[tuple], background: bool = False, progress=None,
                threads: int | None = None, after: threading.Event | None = None) -> WarmUp:
        """Compile `keys` in order (in daemon threads with background=True: `compile_threads()` of
        them take the keys in order, so XLA compiles several programs at once on a many-core host;
        in the foreground one at a time, as multi-process runs need). `threads` > 1 in the
        foreground: that many threads take the keys and the call returns once all are done (a
        single process's first programs: XLA compiles and loads release the GIL). `after` (background
        only): the handle ends, and takes its compile count, once that event is set too (a warm-up
        started beside the caller's foreground one). `progress`: an optional wrapper of the key list
        (a tqdm bar)."""
        handle = WarmUp()
        t0 = time.perf_counter()
        items = iter(progress(keys) if progress else keys)
        take = threading.Lock()
        workers = max(1, threads or (compile_threads() if background else 1))
        left = [workers]

        def run():
            try:
                while not handle.cancelled and handle.error is None:
                    with take:
                        item = next(items, None)
                    if item is None:
                        break
                    self.get(*item)
            except BaseException as e:  # reported by wait()
                handle.error = handle.error or e
            finally:
                with take:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    if after is not None:
                        after.wait()
                    handle._finish(t0)

        if after is not None and not background:
            raise ValueError("warm_up: `after` needs background=True")
        if background:
            _running.add(handle)
        if background or workers > 1:
            for i in range(workers):
                threading.Thread(target=run, name=f"jvllm-warmup-{i}", daemon=True).start()
        else:
            run()
        return handle if background else handle.wait()

    def clear(self):
        with self._lock:
            self._compiled.clear()
