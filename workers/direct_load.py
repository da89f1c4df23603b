"""Loading weights straight into vLLM's parameter storage, through a name→slice map.

vLLM's ``model.load_weights`` maps each checkpoint tensor onto its parameters (q/k/v into
the fused ``qkv_proj``, gate/up into ``gate_up_proj``, a tensor-parallel shard of each),
one Python weight-loader call at a time; on top of that, the layerwise reload that makes it
safe for any model buffers every layer and processes it again. For an unquantized model on
a GPU, where post-load processing does nothing, all of this comes down to a few copies per
tensor: this module records them once and replays them after.

``DirectLoader.load`` runs ``load_weights`` for a name it has not seen (or whose dtype or
shape changed) under a ``TorchFunctionMode`` that records every ``copy_`` from a view of the
incoming tensor into a view of a parameter (as strided views: offset, sizes, strides). A
recipe is kept only if that was *all* the loader did to the parameters (``fill_``/``zero_``
of padding aside, which stays as it is) and every recorded destination then equals its
source. Afterwards the name loads by replaying its copies. A name whose loader does anything
else keeps going through ``load_weights`` (still correct here, since the model qualifies).

``qualifies`` says whether a model qualifies: CUDA (on CPU, linear weights are repacked
after loading), no quantization, every layer's method an unquantized one, no model-level
post-load hook. Anything else uses layerwise reload (``extension.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmq_rollout.protocol import Bucket
from zmq_rollout.weight_sync.buckets import copy_split, split_copies, unpack

from .bucket_loader import BucketLoader

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["DirectLoader", "parameter_pointers", "qualifies", "static_verdict"]


def qualifies(model: Any, model_config: Any, device: Any) -> str:
    """Empty if ``model`` can load directly; else why not (for the log)."""
    return static_verdict(model, model_config, device) or parameter_pointers(model)[1]


def static_verdict(model: Any, model_config: Any, device: Any) -> str:
    """The part of ``qualifies`` that holds for the model's lifetime (device, quantization,
    post-load hooks, each layer's method): a worker works it out once per model."""
    if getattr(device, "type", str(device)) != "cuda":
        return f"device {device} (post-load processing repacks weights off CUDA)"
    if getattr(model_config, "quantization", None):
        return f"quantization {model_config.quantization}"
    if hasattr(model, "process_weights_after_loading"):
        return "the model has its own post-load hook"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return f"layer {name} uses {type(method).__name__}"
    return ""


def parameter_pointers(model: Any) -> tuple[dict[str, int], str]:
    """Each parameter's address, in one walk of the model (what ``DirectLoader.stale``
    compares), and why the model cannot load directly now (a parameter on the meta device)."""
    pointers: dict[str, int] = {}
    for name, param in model.named_parameters():
        if param.is_meta:
            return pointers, f"parameter {name} is on the meta device"
        pointers[name] = param.data_ptr()
    return pointers, ""


@dataclass(frozen=True)
class _Copy:
    param: str
    dst: tuple[int, tuple[int, ...], tuple[int, ...]]  # storage offset, sizes, strides (elements)
    src: tuple[int, tuple[int, ...], tuple[int, ...]]  # offset from the tensor's first element


@dataclass
class _Plan:
    """One bucket's copies, resolved to tensors: destination and source views, built once
    for a buffer that stays mapped (a CUDA IPC buffer) and replayed with a ``copy_`` per
    large one and one foreach copy for the rest (``copy_split``)."""

    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    slow: list[tuple[str, torch.Tensor]]  # names that go through load_weights
    big: list[int] = field(default_factory=list)
    small: list[int] = field(default_factory=list)


@dataclass
class _Recipe:
    key: tuple[str, tuple[int, ...]]  # dtype, shape of the tensor it was recorded with
    copies: list[_Copy] = field(default_factory=list)


class _Recorder:
    """A ``TorchFunctionMode`` body: records copies from ``source`` into parameters."""

    def __init__(self, source: torch.Tensor, params: dict[int, tuple[str, torch.Tensor]]) -> None:
        self.source = source
        self.params = params  # storage data_ptr -> (name, parameter)
        self.copies: list[_Copy] = []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.why_not = ""

    def _param_of(self, t: Any) -> tuple[str, torch.Tensor] | None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device != self.source.device:
            return None
        return self.params.get(t.untyped_storage().data_ptr())

    def see(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        import torch

        name = getattr(func, "__name__", "")
        if name in ("__set__", "__setitem__") and args and self._param_of(args[0]) is not None:
            self.why_not = self.why_not or f"writes a parameter with {name}"
            return
        if not (name.endswith("_") and not name.endswith("__")) or not args:
            return
        target = self._param_of(args[0])
        if target is None:
            return
        if name in ("fill_", "zero_"):
            return  # padding set to a constant: it stays so
        if name != "copy_":
            self.why_not = self.why_not or f"writes a parameter with {name}"
            return
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
        source = self.source
        if (
            not isinstance(src, torch.Tensor)
            or src.device != source.device
            or src.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
            or src.dtype != source.dtype
        ):
            self.why_not = self.why_not or f"copies a transformed tensor into {target[0]}"
            return
        offset = src.storage_offset() - source.storage_offset()
        if offset < 0 or offset >= max(source.numel(), 1):
            self.why_not = self.why_not or "copies from outside the tensor"
            return
        base = target[1]
        self.copies.append(
            _Copy(
                target[0],
                (dst.storage_offset() - base.storage_offset(), tuple(dst.shape), tuple(dst.stride())),
                (int(offset), tuple(src.shape), tuple(src.stride())),
            )
        )
        self.views.append((dst, src))


class DirectLoader(BucketLoader):
    """Per model: recipes by checkpoint name, kept across rounds; ``load`` replays or records."""

    name = "direct"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.recipes: dict[str, _Recipe | None] = {}  # None: always through load_weights
        self._params: dict[str, torch.Tensor] = {n: p.data for n, p in model.named_parameters()}
        self._by_storage = {p.untyped_storage().data_ptr(): (n, p) for n, p in self._params.items() if p.numel()}
        self._plans: dict[tuple[tuple[str, ...], Any], _Plan] = {}
        self._pointers = {n: p.data_ptr() for n, p in self._params.items()}
        # The model's tree as recorded: each submodule in its parent, each parameter object in
        # its module at its address; ``unchanged`` checks it without walking the model again.
        self._modules = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items()]
        self._tensors = [
            (module, name, param, param.data_ptr() if param is not None else 0)
            for module in model.modules()
            for name, param in module._parameters.items()
        ]
        self.num_replayed = 0
        self.num_loaded = 0

    def unchanged(self, model: Any) -> bool:
        """Whether ``model`` is the one recorded, every submodule and parameter object still in
        its place, at its address: then the recipes hold, with no walk of the model (a
        dictionary look-up per module and parameter). False says only: look again (``stale``)."""
        if model is not self.model:
            return False
        if any(parent._modules.get(name) is not child for parent, name, child in self._modules):
            return False
        return all(
            module._parameters.get(name) is param and (param is None or param.data_ptr() == ptr)
            for module, name, param, ptr in self._tensors
        )

    def stale(self, model: Any, pointers: dict[str, int] | None = None) -> bool:
        """Whether ``model`` or its parameters' storage changed since the recipes were made
        (``pointers``: ``parameter_pointers(model)``, if the caller has them already)."""
        if model is not self.model:
            return True
        return (parameter_pointers(model)[0] if pointers is None else pointers) != self._pointers

    def load(self, bucket: Bucket, buffer: torch.Tensor, buffer_key: str | None = None, layout: str = "") -> None:
        """Load a bucket's tensors from ``buffer``; with ``buffer_key`` (a buffer that stays
        mapped under that name until ``forget``), remember the resolved copies and replay a
        bucket laid out the same way from them (``copy_split``): the same ``layout`` name, or
        without one the same names, dtypes, shapes and offsets."""
        self.load_parts([(bucket, buffer)], (buffer_key,) if buffer_key else (), layout)

    def load_parts(
        self, parts: list[tuple[Bucket, torch.Tensor]], buffer_keys: tuple[str, ...] = (), layout: str = ""
    ) -> None:
        """``load`` for several buckets at once, each from its own buffer: one plan for all of
        them, kept while every buffer in ``buffer_keys`` stays mapped."""
        sig: Any = None
        if buffer_keys:
            sig = layout or tuple(
                (m.name, m.dtype, tuple(m.shape), m.offset) for bucket, _ in parts for m in bucket.tensors
            )
        plan = self._plans.get((buffer_keys, sig)) if buffer_keys else None
        if plan is not None:
            copy_split(plan.dsts, plan.srcs, plan.big, plan.small)
            if plan.slow:
                self.model.load_weights(plan.slow)
            self.num_replayed += len(plan.dsts)
            return
        tensors = [t for bucket, buffer in parts for t in unpack(bucket, buffer)]
        self.load_tensors(tensors)
        if buffer_keys and len(self._plans) < 256:
            self._plans[(buffer_keys, sig)] = self._plan(tensors)

    def forget(self, keep_buffer_keys: set[str]) -> None:
        """Drop the plans that read a buffer not in ``keep_buffer_keys`` (it is being unmapped)."""
        for key in [k for k in self._plans if not keep_buffer_keys.issuperset(k[0])]:
            del self._plans[key]

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> _Plan:
        plan = _Plan([], [], [])
        for name, tensor in tensors:
            recipe = self.recipes.get(name)
            if recipe is None:
                plan.slow.append((name, tensor))
            else:
                dsts, srcs = self._views(recipe, tensor)
                plan.dsts += dsts
                plan.srcs += srcs
        plan.big, plan.small = split_copies(plan.dsts, plan.srcs)
        return plan

    def _views(self, recipe: _Recipe, tensor: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The recipe's copies as (destination views of parameters, source views of ``tensor``)."""
        dsts, srcs = [], []
        for c in recipe.copies:
            (offset, sizes, strides), (src_offset, src_sizes, src_strides) = c.dst, c.src
            param = self._params[c.param]
            dsts.append(param.as_strided(sizes, strides, param.storage_offset() + offset))
            srcs.append(tensor.as_strided(src_sizes, src_strides, tensor.storage_offset() + src_offset))
        return dsts, srcs

    def load_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Replay each name's recipe; record it the first time (or when its dtype or shape changed)."""
        slow: list[tuple[str, torch.Tensor]] = []
        for name, tensor in tensors:
            key = (str(tensor.dtype), tuple(tensor.shape))
            if name not in self.recipes:
                self._record(name, tensor)
                continue
            recipe = self.recipes[name]
            if recipe is None:
                slow.append((name, tensor))
            elif recipe.key != key:
                self._record(name, tensor)
            else:
                self._replay(recipe, tensor)
        if slow:
            self.model.load_weights(slow)
            self.num_loaded += len(slow)

    def _replay(self, recipe: _Recipe, tensor: torch.Tensor) -> None:
        for dst, src in zip(*self._views(recipe, tensor), strict=True):
            dst.copy_(src)
        self.num_replayed += 1

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        recorder = _Recorder(tensor, self._by_storage)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                recorder.see(func, tuple(args), kwargs or {})
                return func(*args, **(kwargs or {}))

        with Mode():
            self.model.load_weights([(name, tensor)])
        self.num_loaded += 1
        why_not = recorder.why_not  # no copies at all is a recipe too: the loader skips the name
        devices = {p.device for p in self._params.values()}
        if not why_not and devices != {tensor.device}:  # copies across devices are not seen as ours
            why_not = f"the tensor is on {tensor.device}, the parameters on {sorted(map(str, devices))}"
        if not why_not and not all(torch.equal(d, s.to(d.dtype)) for d, s in recorder.views):
            why_not = "a recorded copy does not reproduce what the loader wrote"
        if why_not:
            log.info("weight sync: %s loads through load_weights: %s", name, why_not)
            self.recipes[name] = None
        else:
            self.recipes[name] = _Recipe((str(tensor.dtype), tuple(tensor.shape)), recorder.copies)
