"""``DeviceOwner``: the single owner of every device resource a runner allocates.

Principle: a tensor that is not registered here must not exist. ``close()`` is the only release
path; it releases in reverse order of creation and leaves nothing behind — even a reference that
leaked out of the owner no longer pins device memory, because released tensors are emptied in
place (``Tensor.set_()``) and released modules have their parameters and buffers emptied.

``reachable_tensors(obj)`` walks an object graph and lists every tensor/module still reachable; the
release tests assert it is empty for a runner after ``shutdown()``.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import gc
import logging
import platform
import time
import types
from typing import Any, Iterator

import torch
from torch import nn

log = logging.getLogger("enginecore.owner")


def empty_in_place(obj: Any) -> None:
    """Drop the storage behind ``obj`` (a tensor, module, or container of them) in place."""
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.set_()
    elif isinstance(obj, nn.Module):
        for t in list(obj.parameters(recurse=True)) + list(obj.buffers(recurse=True)):
            with torch.no_grad():
                t.data = torch.empty(0, dtype=t.dtype, device="cpu")
        for m in obj.modules():  # kernel-owned weights (engine/ops/cpu/packed_linear.py)
            release = getattr(m, "release_packed", None)
            if callable(release):
                release()
    elif isinstance(obj, dict):
        for v in obj.values():
            empty_in_place(v)
        obj.clear()
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            empty_in_place(v)
        if isinstance(obj, (list, set)):
            obj.clear()
    elif hasattr(obj, "close") and callable(obj.close):
        obj.close()


class Resource(str, enum.Enum):
    """The names of a runner's device resources, in creation order."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    MODEL_STATE = "model_state"
    CUDA_GRAPHS = "cuda_graphs"
    GRAMMAR_BITMASK = "grammar_bitmask"  # structured outputs' token bitmask (engine/structured/)
    SPECULATOR = "speculator"
def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def storage_bytes(obj: Any, limit: int = 100_000) -> dict[str, int]:
    """Bytes of the distinct tensor storages reachable from ``obj`` (modules' parameters and
    buffers, containers, attributes), each storage counted once, by device (``"cuda:0"``, or
    ``"cpu"`` for a resource offloaded to host memory)."""
    seen_storage: set[int] = set()
    seen: set[int] = set()
    total: dict[str, int] = {}
    stack = [obj]
    while stack and len(seen) < limit:
        o = stack.pop()
        if isinstance(o, _ATOMS) or isinstance(o, (types.ModuleType, types.FunctionType, type)) \
                or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = st.data_ptr() or id(st)
            if key not in seen_storage:
                seen_storage.add(key)
                total[str(o.device)] = total.get(str(o.device), 0) + st.nbytes()
        elif isinstance(o, nn.Module):
            stack.extend(o.parameters(recurse=True))
            stack.extend(o.buffers(recurse=True))
        else:
            stack.extend(child for _, child in _children(o))
    return total


class DeviceOwner:
    """Ordered registry of named device resources.

    A resource is a tensor, an ``nn.Module``, a container of them, or an object with ``close()``
    (which must release everything it holds). ``owner[name]`` reads one; there is no way to take a
    resource out other than ``close()``.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._resources: dict[str, Any] = {}
        self.closed = False

    def adopt(self, name: Resource, resource: Any) -> Any:
        name = Resource(name)  # a typo'd name fails here, not at release
        if self.closed:
            raise RuntimeError(f"owner is closed; cannot adopt {name!r}")
        if name in self._resources:
            raise KeyError(f"resource {name!r} is already owned")
        self._resources[name] = resource
        # NOTE: kept in Resource order, the creation order of a load: a resource adopted again
        # after a sleep (KV cache, model state, graphs) takes its place again, so close() still
        # releases in reverse creation order.
        order = list(Resource)
        self._resources = dict(sorted(self._resources.items(), key=lambda kv: order.index(kv[0])))
        return resource

    def __getitem__(self, name: str) -> Any:
        try:
            return self._resources[name]
        except KeyError:
            state = "closed" if self.closed else f"owns {list(self._resources)}"
            raise KeyError(f"no resource {name!r} ({state})") from None

    def get(self, name: str, default: Any = None) -> Any:
        return self._resources.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self._resources

    def names(self) -> list[str]:
        return list(self._resources)

    def release(self, name: str) -> int:
        """Release one resource now (e.g. a speculator swapped out); same path as close().
        Returns (and logs) the bytes of tensor storage it held."""
        resource = self._resources.pop(name)
        by_device = storage_bytes(resource)
        nbytes = sum(by_device.values())
        where = ", ".join(f"{format_bytes(n)} on {d}" for d, n in sorted(by_device.items()))
        t0 = time.perf_counter()
        empty_in_place(resource)
        label = Resource(name).value
        log.info("released %s: %s (%.1f ms)", label, where or f"0 B on {self.device}",
                 1e3 * (time.perf_counter() - t0),
                 extra={"resource": label, "bytes": nbytes,
                        "device": ",".join(sorted(by_device)) or str(self.device)})
        return nbytes

    def offload(self, name: str, pin: bool) -> int:
        """Sleep level 1: move resource ``name`` to host memory (page-locked if ``pin``) and keep
        it owned. A module's tensors get host storage in place (``engine.memory.weights``); another
        resource does it itself (``offload(pin)``: e.g. the draft's, which releases its cache
        and buffers and offloads its model). Returns the bytes now in host memory."""
        from .weights import offload_module

        resource = self._resources[name]
        moved = offload_module(resource, pin) if isinstance(resource, nn.Module) else resource.offload(pin)
        log.debug("offloaded %s (%d bytes)", name, moved)
        return moved

    def restore(self, name: str) -> int:
        """The way back from :meth:`offload`: copy resource ``name`` to the owner's device; the
        page-locked host copies are given back."""
        from .weights import restore_module

        resource = self._resources[name]
        moved = restore_module(resource, self.device) if isinstance(resource, nn.Module) else resource.restore(self.device)
        if self.device.type == "cuda":
            empty_host_cache()
        return moved

    def empty_device_cache(self) -> None:
        """Collect, then hand the caching allocator's free segments (and cuBLAS's workspaces,
        and the cached page-locked host blocks) back: after a release, memory_reserved shows
        only what is still owned."""
        gc.collect()
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
            # NOTE: cuBLAS keeps per-handle workspaces (32 MiB on Hopper) in the caching
            # allocator; they pin a whole segment unless cleared. Measured on the H200.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
            empty_host_cache()

    def close(self) -> list[str]:
        """Synchronize the device, release everything in reverse order of creation, collect.

        Returns the names in the order released. Safe to call twice.
        """
        order: list[str] = []
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        for name in reversed(list(self._resources)):
            self.release(name)
            order.append(name)
        self.closed = True
        self.empty_device_cache()
        return order


def empty_host_cache() -> None:
    """Give the cached page-locked host blocks back (torch keeps freed pinned memory cached)."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch >= 2.13
    if fn is None:
        fn = getattr(torch._C, "_host_emptyCache", None)  # older releases
    if fn is not None:
        fn()


@functools.lru_cache(maxsize=1)
def libc_malloc_trim():
    """glibc's ``malloc_trim`` through ctypes, or None off glibc (e.g. musl, macOS).
    (entrypoints/malloc.py's ``Trimmer`` looks it up itself: the HTTP frontend that uses it must
    not import torch, which this module does.)"""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_host_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``, every arena);
    True if it ran. After a CPU load: the GGUF's dequantized and transposed temporaries were
    freed but glibc kept their pages (resident) until trimmed."""
    trim = libc_malloc_trim()
    if trim is None:
        return False
    gc.collect()
    trim(0)
    return True


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    else:
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for k, v in d.items():
                yield f".{k}", v
        for slot in getattr(type(obj), "__slots__", ()) or ():
            if hasattr(obj, slot):
                yield f".{slot}", getattr(obj, slot)
        func = getattr(obj, "__func__", None)  # bound methods
        if func is not None:
            yield ".__self__", getattr(obj, "__self__", None)
        for i, cell in enumerate(getattr(obj, "__closure__", None) or ()):
            try:
                yield f".<closure{i}>", cell.cell_contents
            except ValueError:
                pass


_ATOMS = (str, bytes, int, float, complex, bool, type(None), type, torch.dtype, torch.device)


def reachable_tensors(root: Any, limit: int = 200_000) -> list[str]:
    """Paths from ``root`` to every ``torch.Tensor`` or ``nn.Module`` still reachable.

    Walks instance attributes, slots, containers, bound methods and closures — not module
    globals or classes (those are not the runner's). An emptied tensor (0 elements, e.g. after
    ``set_()``) holds no memory but is still reported: after a release nothing should remain.
    """
    import types

    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("root", root)]
    while stack and len(seen) < limit:
        path, obj = stack.pop()
        if isinstance(obj, _ATOMS) or isinstance(obj, (types.ModuleType, types.FunctionType)) and not getattr(obj, "__closure__", None):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, nn.Module, torch.ScriptObject)):
            found.append(f"{path}: {type(obj).__name__}")
            continue
        for name, child in _children(obj):
            stack.append((path + name, child))
    return found
