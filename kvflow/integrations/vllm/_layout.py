"""vLLM's per-layer KV cache tensors, described as one kvflow cache.

vLLM hands a connector one tensor per attention layer, in the layout its attention backend chose:
``(2, num_blocks, block_size, heads, head_size)`` (K and V apart, FlashAttention), ``(num_blocks, 2,
block_size, heads, head_size)`` (K and V of a block together, FlashInfer), a permuted view of
either (the ``HND`` layout), or ``(num_blocks, block_size, head_size)`` (MLA). kvflow moves whole
blocks of tensors that are ``shape[0]`` blocks of equal, adjacent bytes.

So, from each tensor's shape and strides: the block dimension is the one of ``num_blocks`` elements
whose lower-stride dimensions tile its stride exactly (a block's bytes are one dense slab), and
every higher-stride dimension (K/V) splits the tensor into several kvflow tensors. A layer of
``(2, B, ...)`` becomes two kvflow tensors (K, V), a layer of ``(B, 2, ...)`` one. Anything else
(padding between blocks, a block spread over two slabs) is refused before anything is registered.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvflow import CacheDesc, DataType, LLMParamInvalid, Placement

_DTYPES: dict[torch.dtype, DataType] = {
    torch.float16: DataType.DT_FLOAT16,
    torch.bfloat16: DataType.DT_BF16,
    torch.float32: DataType.DT_FLOAT,
    torch.float64: DataType.DT_DOUBLE,
    torch.int8: DataType.DT_INT8,
    torch.uint8: DataType.DT_UINT8,
    torch.int16: DataType.DT_INT16,
    torch.int32: DataType.DT_INT32,
    torch.int64: DataType.DT_INT64,
}


@dataclass(frozen=True)
class Layout:
    """What to register: ``tensors`` (2-D views ``[num_blocks, block_bytes]``, layer by layer) under
    ``desc``; ``per_layer`` kvflow tensors per vLLM layer; ``layers`` the layer names, in order."""

    desc: CacheDesc
    tensors: list[torch.Tensor]
    per_layer: int
    layers: list[str]

    @property
    def block_bytes(self) -> int:
        return int(self.tensors[0].shape[1])


def _split(shape: Sequence[int], stride: Sequence[int], num_blocks: int) -> tuple[int, list[int]] | None:
    """(block dim, outer dims) if a dimension of ``num_blocks`` (or a multiple: kernel blocks) elements has
    lower-stride dimensions that tile its stride exactly, and every other one lies beyond all blocks."""
    dims = [i for i, n in enumerate(shape) if n != 1]
    for d in (i for i in dims if shape[i] % num_blocks == 0):  # a multiple: kernel blocks smaller than vLLM's
        inner = sorted((i for i in dims if i != d and stride[i] < stride[d]), key=lambda i: stride[i])
        outer = [i for i in dims if i != d and stride[i] >= stride[d] * shape[d]]
        if len(inner) + len(outer) + 1 != len(dims):
            continue  # a dimension overlaps the blocks: neither inside a block nor outside them all
        span = 1
        for i in inner:
            if stride[i] != span:
                break
            span *= shape[i]
        else:
            if span == stride[d]:
                return d, outer
    return None


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole storage (same device)."""
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device)
    return u8.set_(t.untyped_storage())


def describe(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> Layout:
    """Split vLLM's per-layer tensors into kvflow tensors; LLMParamInvalid for what cannot be addressed."""
    if not kv_caches:
        raise LLMParamInvalid("no KV cache tensors to register")
    first = next(iter(kv_caches.values()))
    tensors: list[torch.Tensor] = []
    per_layer = 0
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise LLMParamInvalid(f"layer {name}: expected a torch.Tensor, got {type(t).__name__}")
        if (t.dtype, t.device, tuple(t.shape), t.stride()) != (first.dtype, first.device, tuple(first.shape),
                                                               first.stride()):
            raise LLMParamInvalid(f"layer {name}: {t.dtype} {tuple(t.shape)} stride {t.stride()} on {t.device} "
                                  f"differs from the first layer's {first.dtype} {tuple(first.shape)} stride "
                                  f"{first.stride()}: kvflow needs one layout for every layer")
        found = _split(t.shape, t.stride(), num_blocks)
        if found is None:
            raise LLMParamInvalid(f"layer {name}: shape {tuple(t.shape)} stride {t.stride()} has no dimension of "
                                  f"(a multiple of) {num_blocks} blocks whose bytes are one dense slab per block")
        d, outer = found
        item = t.element_size()
        slab = t.stride()[d] * item * (t.shape[d] // num_blocks)  # the bytes of one of vLLM's blocks
        u8 = _bytes_of(t)
        for idx in itertools.product(*(range(t.shape[i]) for i in outer)):
            start = (t.storage_offset() + sum(j * t.stride()[i] for i, j in zip(outer, idx))) * item
            tensors.append(u8[start:start + num_blocks * slab].view(num_blocks, slab))
        per_layer = 1
        for i in outer:
            per_layer *= t.shape[i]
    dtype = _DTYPES.get(first.dtype, DataType.DT_UINT8)
    width = tensors[0].shape[1] // (first.element_size() if dtype is not DataType.DT_UINT8 else 1)
    placement = Placement.HOST if first.device.type == "cpu" else Placement.DEVICE
    desc = CacheDesc(num_tensors=len(tensors), shape=[num_blocks, int(width)], data_type=dtype, placement=placement)
    return Layout(desc, tensors, per_layer, list(kv_caches))

