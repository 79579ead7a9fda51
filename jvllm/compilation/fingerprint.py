"""A program's fingerprint: a cheap key of everything its lowered module is made from, computed
from its `Signature` without tracing it, so a warm start loads executables without tracing or
lowering anything.

A traced program is a function of (the code that runs while tracing, the values it closes over,
its abstract arguments, the tracing library's state). The fingerprint hashes each of them:
  code      sha256 of every .py file of jvllm (with jvllm.converters and jvllm.sharding), the
            versions of the libraries that take part in tracing and compiling (jax, jaxlib, flax,
            numpy, ml_dtypes, the jax plugins, tokamax, libtpu), the backend's platform version
  closure   the jitted function described structurally: functools.partial args and keywords,
            function identity (module, qualname, file, first line) and closure cells, dataclasses
            field by field (frozen configs, nnx GraphDef nodes and their static attributes), the
            jit options (donation, static arguments, shardings)
  arguments shapes, dtypes, weak types and shardings (mesh device ids, axis names, spec) of the
            abstract arguments, the static keyword arguments, the devices
  state     jax.config's values (x64, matmul precision, ...; not those naming caches, logging or
            the platform list: the backend itself is in), XLA_FLAGS, process count

Only values whose description is exact are accepted: anything else (a function from outside the
libraries above, e.g. a user logits processor; a concrete array; an object whose type this module
does not know) raises `Unfingerprintable`, and the caller falls back to the lowered module's key
(`executable_cache.executable_key`), which is always correct but needs a trace and a lowering.

Hazard: a program whose trace reads mutable Python state that is none of the above (a module
global changed at run time) would not be seen; jvllm's programs read none (their inputs are their
partial arguments and abstract arguments), and a new program kind must keep it so.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import re
import threading
import types
from collections.abc import Mapping

import jax
import numpy as np

# libraries whose functions may be named in a closure: their code is pinned by their versions
_LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "tokamax", "builtins", "math", "operator", "functools")
_DISTRIBUTIONS = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "tokamax", "libtpu", "jax-cuda12-plugin",
                  "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-rocm-plugin", "jax-rocm-pjrt")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{5,}")
_SMALL_ARRAY_BYTES = 1 << 16
_WHERE_NOT_WHAT = frozenset({"jax_platforms", "jax_platform_name", "jax_log_compiles", "jax_logging_level"})


class Unfingerprintable(TypeError):
    """A value whose exact description is unknown: the program must be keyed by its lowered module."""


def _package_dirs() -> list[str]:
    import jvllm
    import jvllm.converters
    import jvllm.sharding

    return sorted({os.path.dirname(os.path.abspath(m.__file__)) for m in (jvllm, jvllm.converters, jvllm.sharding)})


def source_digest(dirs: list[str] | None = None) -> str:
    """sha256 over the relative path and bytes of every .py file under `dirs` (default: jvllm's
    package folders), in sorted order."""
    h = hashlib.sha256()
    for root in dirs or _package_dirs():
        files = []
        for d, subdirs, names in os.walk(root):
            subdirs[:] = sorted(s for s in subdirs if s != "__pycache__")
            files += [os.path.join(d, n) for n in names if n.endswith(".py")]
        for path in sorted(files):
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
    return h.hexdigest()


def _versions() -> tuple:
    from importlib import metadata

    out = []
    for name in _DISTRIBUTIONS:
        try:
            out.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            out.append((name, None))
    return tuple(out)


_static_lock = threading.Lock()
_static: dict = {}


def _process_constants() -> tuple:
    """What cannot change inside one process: jvllm's source digest and library versions."""
    with _static_lock:
        if "v" not in _static:
            from jax._src.lib import version_str as jaxlib_version

            _static["v"] = (source_digest(), jax.__version__, jaxlib_version, _versions())
        return _static["v"]


def environment() -> tuple:
    """The process constants, plus what may change between programs: jax's config values (this
    thread's), XLA_FLAGS, the backend and its platform version, the process count."""
    cfg = []
    for name in sorted(jax.config.values):
        if name in _WHERE_NOT_WHAT or "cache" in name:  # where caches and logs go, not what is built
            continue
        try:
            v = getattr(jax.config, name)
        except AttributeError:
            v = jax.config.values[name]
        cfg.append((name, type(v).__name__, repr(v)))  # plain values; one holding an address only misses
    client = jax.devices()[0].client
    return (_process_constants(), tuple(cfg), os.environ.get("XLA_FLAGS", ""), jax.default_backend(),
            getattr(client, "platform_version", None), jax.process_count())


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', None))}"


def _own_module(module: str | None) -> bool:
    return bool(module) and (module == "jvllm" or module.startswith("jvllm."))


def _library_module(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in _LIBRARIES


def _function(fn, seen):
    module = getattr(fn, "__module__", None)
    if not (_own_module(module) or _library_module(module)):
        raise Unfingerprintable(f"function {_qualified(fn)} is neither jvllm's nor a pinned library's")
    code = getattr(fn, "__code__", None)
    if code is None:  # a builtin / C function of a pinned library
        return ("fn", _qualified(fn))
    cells = tuple(_describe(c.cell_contents, seen) for c in (fn.__closure__ or ()))
    return ("fn", _qualified(fn), os.path.basename(code.co_filename), code.co_firstlineno, cells,
            _describe(fn.__defaults__, seen), _describe(fn.__kwdefaults__, seen))


def _sharding(s, seen):
    from jax.sharding import NamedSharding, SingleDeviceSharding

    if isinstance(s, NamedSharding):
        return ("named", _mesh(s.mesh), repr(s.spec), s.memory_kind)
    if isinstance(s, SingleDeviceSharding):
        return ("single", _device(next(iter(s.device_set))), s.memory_kind)
    raise Unfingerprintable(f"sharding of type {type(s).__name__}")


def _mesh(m):
    return ("mesh", tuple(int(d.id) for d in m.devices.flat), tuple(m.devices.shape), tuple(m.axis_names),
            repr(getattr(m, "axis_types", None)))


def _device(d):
    return ("device", int(d.id), d.platform, getattr(d, "device_kind", None), int(d.process_index))


def _describe(x, seen):  # noqa: C901 (one dispatch over the known types, in one place)
    from jax.sharding import Mesh, PartitionSpec

    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return (type(x).__name__, repr(x))
    if isinstance(x, enum.Enum):
        return ("enum", _qualified(type(x)), x.name)
    if id(x) in seen:
        raise Unfingerprintable(f"a reference cycle through {type(x).__name__}")
    seen = seen | {id(x)}
    if isinstance(x, (tuple, list)):
        fields = getattr(type(x), "_fields", None)  # a NamedTuple: its fields by name
        items = tuple(_describe(v, seen) for v in x)
        return (_qualified(type(x)), fields, items)
    if isinstance(x, Mapping):
        items = sorted(((repr(k), _describe(v, seen)) for k, v in x.items()), key=lambda kv: kv[0])
        return (_qualified(type(x)), tuple(items))
    if isinstance(x, (set, frozenset)):
        return (_qualified(type(x)), tuple(sorted(repr(_describe(v, seen)) for v in x)))
    if isinstance(x, type):
        if not (_own_module(x.__module__) or _library_module(x.__module__)):
            raise Unfingerprintable(f"class {_qualified(x)} is neither jvllm's nor a pinned library's")
        return ("type", _qualified(x))
    if isinstance(x, np.dtype):
        return ("dtype", str(x))
    if isinstance(x, jax.ShapeDtypeStruct):
        return ("sds", tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                _sharding(x.sharding, seen) if x.sharding is not None else None)
    if isinstance(x, PartitionSpec):
        return ("spec", repr(x))
    if isinstance(x, Mesh):
        return _mesh(x)
    if isinstance(x, jax.sharding.Sharding):
        return _sharding(x, seen)
    if isinstance(x, jax.Device):
        return _device(x)
    if isinstance(x, jax.tree_util.PyTreeDef):
        text = str(x)
        if _ADDRESS.search(text):
            raise Unfingerprintable(f"a tree structure whose text holds an address: {text[:200]}")
        return ("treedef", text)
    if isinstance(x, inspect.Signature):
        text = str(x)
        if _ADDRESS.search(text):
            raise Unfingerprintable(f"a signature whose text holds an address: {text[:200]}")
        return ("signature", text)
    if isinstance(x, np.ndarray):
        if x.nbytes > _SMALL_ARRAY_BYTES or x.dtype == object:
            raise Unfingerprintable(f"a numpy array of {x.nbytes} bytes ({x.dtype}) in a closure")
        return ("ndarray", x.shape, str(x.dtype), hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest())
    if isinstance(x, np.generic):
        return ("scalar", str(x.dtype), repr(x.item()))
    if isinstance(x, functools.partial):
        return ("partial", _describe(x.func, seen), _describe(x.args, seen), _describe(x.keywords, seen))
    if type(x).__name__ == "PjitFunction" and hasattr(x, "_jit_info"):
        return ("jit", _describe(x.__wrapped__, seen), _describe(x._jit_info, seen))
    if isinstance(x, np.ufunc):
        return ("ufunc", x.__name__)
    if isinstance(x, types.MethodType):
        return ("method", _describe(x.__self__, seen), _function(x.__func__, seen))
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType)):
        return _function(x, seen)
    if dataclasses.is_dataclass(x):
        return (_qualified(type(x)), tuple((f.name, _describe(getattr(x, f.name), seen))
                                           for f in dataclasses.fields(x)))
    graphdef = _graphdef(x, seen)
    if graphdef is not None:
        return graphdef
    if _library_module(type(x).__module__) and type(x).__name__ == "UnspecifiedValue":
        return ("unspecified",)
    raise Unfingerprintable(f"a value of type {_qualified(type(x))}")


def _graphdef(x, seen):
    """flax nnx graph definitions: their nodes and attributes (the pretty repr omits attributes)."""
    try:
        from flax.nnx import graph
    except ImportError:
        return None
    if isinstance(x, graph.GraphDef):
        return ("graphdef", _describe(tuple(x.nodes), seen), _describe(tuple(x.attributes), seen),
                _describe(getattr(x, "num_leaves", None), seen))
    for cls in ("NodeDef", "VariableDef", "NodeAttr", "LeafAttr", "Static", "ArrayRefDef", "IndexesPytreeDef"):
        if isinstance(x, getattr(graph, cls, ())):
            if dataclasses.is_dataclass(x):
                return (cls, tuple((f.name, _describe(getattr(x, f.name), seen)) for f in dataclasses.fields(x)))
            if hasattr(x, "_fields"):
                return (cls, tuple((n, _describe(getattr(x, n), seen)) for n in x._fields))
            if hasattr(x, "__slots__") or hasattr(x, "__dict__"):
                names = sorted(set(getattr(x, "__slots__", ())) | set(vars(x) if hasattr(x, "__dict__") else ()))
                return (cls, tuple((n, _describe(getattr(x, n), seen)) for n in names))
    return None


def fingerprint(kind_name: str, key, sig, memo: dict | None = None) -> str:
    """The fingerprint of program (kind_name, key) from its Signature; raises Unfingerprintable
    (naming the value) when some part of it has no exact description. `memo` (id(fn) -> (fn,
    description)) spares describing one jitted function again for each of its buckets; it keeps
    the functions alive, so it must live no longer than they are meant to (one runner's programs)."""
    hit = memo.get(id(sig.fn)) if memo is not None else None
    if hit is not None and hit[0] is sig.fn:
        fn_desc = hit[1]
    else:
        fn_desc = _describe(sig.fn, set())
        if memo is not None:
            memo[id(sig.fn)] = (sig.fn, fn_desc)
    desc = (environment(), kind_name, _describe(key, set()), fn_desc, _describe(sig.args, set()),
            _describe(sig.kwargs, set()), tuple(_device(d) for d in sig.devices))
    return "f" + hashlib.sha256(repr(desc).encode()).hexdigest()
