"""Initial weights without a whole copy: a model built on the meta device is given its
values module by module, each rank writing only the part of each tensor it holds.

- Random initial values are a function of (seed, module name) only: every module's own
  tensors are materialised whole in one bounded buffer, initialised by transformers'
  `_init_weights` for that module (peft's rule for LoRA adapters) under a generator seeded
  from the seed and the module's name, and each rank keeps its slice. So any strategy on any
  number of processes starts from the same values.
- Pretrained tensors are read from the folder's safetensors files, each rank reading only
  its slice (`get_slice`), with transformers' own key renames for the architecture.
  Parameters the files lack (a new classification head) get the seeded initialisation.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from accord.compat.torch import buffer_table, is_persistent_buffer, local_offset, parameter_table
from accord.compat.transformers import init_weights

SOURCE_ATTRIBUTE = "accord_weights"


@dataclass(frozen=True)
class WeightsSource:
    """Where a meta-device model's values come from: the folder's safetensors (None: a
    model built from a config) and the seed of whatever is initialised at random."""

    folder: Path | None
    seed: int


def attach_source(model: nn.Module, source: WeightsSource) -> None:
    setattr(model, SOURCE_ATTRIBUTE, source)  # deepcopy (DPO's reference) keeps it


def source_of(model: nn.Module) -> WeightsSource | None:
    return getattr(model, SOURCE_ATTRIBUTE, None)  # through peft's wrappers too


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str) -> str:
    """A module's name with peft's wrapping taken out, so a base model's values do not
    depend on whether adapters are added."""
    name = re.sub(r"^base_model\.model(\.|$)", "", name)
    # A wrapped layer, and the trained copy of a head (modules_to_save) next to the original.
    return re.sub(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.|$)", "", name)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a (possibly sharded) meta-device model real storage on `device` and fill it from
    its WeightsSource. A model that holds no meta tensors is left as it is."""
    if not is_meta(model):
        return model
    source = source_of(model)
    if source is None:
        raise ValueError(f"{type(model).__name__} is on the meta device but has no weights source")
    ties = _shared_parameters(model)
    model.to_empty(device=device)
    _retie(ties)
    fill(model, source)
    return model


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter held by more than one module (tied embeddings), as (module, name) slots."""
    slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in parameter_table(module).items():
            if p is not None:
                slots[id(p)].append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def _retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """to_empty replaces a meta parameter per slot; point every slot at the first again."""
    for slots in ties:
        first_module, first_name = slots[0]
        shared = parameter_table(first_module)[first_name]
        for module, name in slots[1:]:
            if parameter_table(module)[name] is not shared:
                parameter_table(module)[name] = shared


@torch.no_grad()
def fill(model: nn.Module, source: WeightsSource, select: Callable[[str], bool] | None = None) -> None:
    """Write every tensor's values (each rank its local part), one module at a time.
    `select` limits it to the modules whose (full) names it accepts."""
    checkpoint = Checkpoint(source.folder, model) if source.folder is not None else None
    owners = _init_owners(model)
    seen: set[int] = set()
    try:
        with torch.random.fork_rng(devices=[]):
            for name, module in model.named_modules():
                if select is not None and not select(name):
                    continue
                tensors = _direct_tensors(module, seen)
                if tensors:
                    _fill_module(name, module, tensors, source.seed, checkpoint, owners)
    finally:
        if checkpoint is not None:
            checkpoint.close()


def _direct_tensors(module: nn.Module, seen: set[int]) -> list[tuple[str, torch.Tensor, bool]]:
    out = []
    for table, is_param in ((parameter_table(module), True), (buffer_table(module), False)):
        for key, t in table.items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((key, t, is_param))
    return out


def _fill_module(name, module, tensors, seed, checkpoint, owners) -> None:
    regions = {key: _local_part(tensor) for key, tensor, _ in tensors}
    values = _module_values(
        name, module, tensors, seed, checkpoint, owners, {k: (o, tuple(t.shape)) for k, (t, o) in regions.items()}
    )
    for key, (local, _) in regions.items():
        if local.numel():
            local.copy_(values[key].to(dtype=local.dtype))


def _module_values(
    name, module, tensors, seed, checkpoint, owners, regions, skip=frozenset()
) -> dict[str, torch.Tensor]:
    """The values of the region (offset, shape) of each of a module's own tensors: read from
    the checkpoint where it holds them, else initialised (the whole module's tensors once,
    in one bounded buffer). Keys in `skip` are only allocated (another rank provides them)."""
    full_name = lambda key: canonical_name(f"{name}.{key}" if name else key)  # noqa: E731
    persistent = lambda key, is_param: is_param or is_persistent_buffer(module, key)  # noqa: E731
    stored = {}
    if checkpoint is not None:
        stored = {key: checkpoint.key_for(full_name(key)) for key, _, is_param in tensors if persistent(key, is_param)}
        stored = {k: v for k, v in stored.items() if v is not None}
    dtypes = {key: t.dtype for key, t, _ in tensors}
    shadows: dict[str, torch.Tensor] = {}
    if any(key not in stored and key not in skip for key, _, _ in tensors):
        shadows = _initial_values(name, module, tensors, seed, owners)
    values = {}
    for key, _, _ in tensors:
        offset, shape = regions[key]
        if key in skip:
            values[key] = torch.empty(shape, dtype=dtypes[key])
        elif math.prod(shape) == 0:
            values[key] = torch.empty(shape, dtype=dtypes[key])
        elif key in stored:
            values[key] = checkpoint.read(stored[key], offset, shape).to(dtypes[key])
        else:
            values[key] = shadows[key][slice_of(offset, shape)]
    return values


@torch.no_grad()
def materialize_each_parameter(model: nn.Module, convert: Callable[[nn.Parameter], None], provider: bool) -> nn.Module:
    """For strategies that partition parameters themselves (DeepSpeed ZeRO-3): each meta
    parameter in turn becomes a whole CPU tensor, with its values where `provider` is true
    (elsewhere only allocated: `convert` takes the provider's values, as ZeRO-3's partitioning
    broadcasts from rank 0), and is handed to `convert`, which keeps this rank's partition and
    frees the rest. Buffers (not partitioned) get their values on every rank. The peak is one
    module's own tensors."""
    source = source_of(model)
    if source is None or not is_meta(model):
        return model
    checkpoint = Checkpoint(source.folder, model) if source.folder is not None else None
    owners = _init_owners(model)
    slots: dict[int, list[tuple[dict, str]]] = defaultdict(list)
    for module in model.modules():
        for table in (parameter_table(module), buffer_table(module)):
            for key, t in table.items():
                if t is not None:
                    slots[id(t)].append((table, key))
    seen: set[int] = set()
    try:
        with torch.random.fork_rng(devices=[]):
            for name, module in model.named_modules():
                tensors = [(k, t, p) for k, t, p in _direct_tensors(module, seen) if t.is_meta]
                if not tensors:
                    continue
                regions = {key: ((0,) * t.dim(), tuple(t.shape)) for key, t, _ in tensors}
                skip = frozenset() if provider else frozenset(key for key, _, is_param in tensors if is_param)
                values = _module_values(name, module, tensors, source.seed, checkpoint, owners, regions, skip)
                for key, old, is_param in tensors:
                    new = nn.Parameter(values[key], requires_grad=old.requires_grad) if is_param else values[key]
                    for table, slot in slots[id(old)]:
                        table[slot] = new
                    if is_param:
                        convert(new)
                    del values[key], new
    finally:
        if checkpoint is not None:
            checkpoint.close()
    return model


def _initial_values(name, module, tensors, seed, owners) -> dict[str, torch.Tensor]:
    """The module's own tensors, whole, on the CPU, initialised as transformers (or peft)
    initialises that module, from a generator seeded by (seed, module name)."""
    shadows = {key: torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu") for key, t, _ in tensors}
    params, buffers = parameter_table(module), buffer_table(module)
    tables = {key: (params if is_param else buffers) for key, _, is_param in tensors}
    originals = {key: tables[key][key] for key in shadows}
    try:
        for key, shadow in shadows.items():
            tables[key][key] = nn.Parameter(shadow, requires_grad=False) if tables[key] is params else shadow
        torch.manual_seed(name_seed(seed, canonical_name(name)))
        _init_module(name, module, owners)
    finally:
        for key, original in originals.items():
            tables[key][key] = original
    return shadows


def _init_module(name: str, module: nn.Module, owners: dict[str, Callable[[nn.Module], None]]) -> None:
    parts = name.split(".")
    if "lora_A" in parts or "lora_embedding_A" in parts:  # peft's default: A uniform (Kaiming), B zero
        for p in module.parameters(recurse=False):
            nn.init.kaiming_uniform_(p, a=math.sqrt(5)) if p.dim() > 1 else nn.init.zeros_(p)
        return
    if "lora_B" in parts or "lora_embedding_B" in parts:
        for p in module.parameters(recurse=False):
            nn.init.zeros_(p)
        return
    owner = _owner(name, owners)
    if owner is not None:
        owner(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _init_owners(model: nn.Module) -> dict[str, Callable[[nn.Module], None]]:
    """Module name -> the `_init_weights` of each transformers model in the tree (the
    nearest one above a module initialises it, as transformers' own init dispatches)."""
    from transformers import PreTrainedModel

    return {name: init_weights(m) for name, m in model.named_modules() if isinstance(m, PreTrainedModel)}


def _owner(name: str, owners: dict[str, Callable[[nn.Module], None]]) -> Callable[[nn.Module], None] | None:
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        prefix = ".".join(parts[:i])
        if prefix in owners:
            return owners[prefix]
    return None


def _local_part(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The storage this rank writes and where it sits in the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        with torch.no_grad():  # the local shard itself (to_local differentiates otherwise)
            return tensor.to_local(), local_offset(tensor)
    return tensor.data, (0,) * tensor.dim()


def slice_of(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


class Checkpoint:
    """A model folder's weights, read lazily: model name -> (file, stored key), with the
    renames transformers applies when loading this architecture (legacy names, a base
    model's prefix added or taken away). safetensors are read slice by slice; a folder with
    only PyTorch `.bin` files is memory-mapped, so a slice also touches only its own pages."""

    def __init__(self, folder: Path, model: nn.Module):
        self.folder = Path(folder)
        self._handles = {f: self._open(f) for f in self._files()}
        stored = {key: f for f, h in self._handles.items() for key in h.keys()}
        self._keys, self._merged = _rename(stored, model)
        self._keys |= {name: name for name in self._merged}  # read through the stored experts
        self._stored = stored
        self._check_shapes(model)

    def _check_shapes(self, model: nn.Module) -> None:
        """Stored tensors whose shape is not the model's (weights from another config) stop
        the run with one line here, not with a copy error in the middle of loading."""
        from accord.errors import UserInputError

        for name, tensor in _named_tensors(model):
            key = self._keys.get(canonical_name(name))
            if key is None:
                continue
            want = tuple(getattr(tensor, "ds_shape", None) or tensor.shape)
            have = self._shape(key)
            if have != want:
                first = self._merged[key][0][0] if key in self._merged else key
                raise UserInputError(
                    f"model.path: {self.folder / self._stored[first]} holds {key} of shape {list(have)}, "
                    f"but the model its config.json describes wants {list(want)}: the weights and config.json "
                    "come from different models; re-save the folder with save_pretrained"
                )

    def _shape(self, key: str) -> tuple[int, ...]:
        if key in self._merged:  # experts × (their pieces joined) × ...
            sources = self._merged[key]
            pieces = [self._shape(keys[0]) for keys in sources]
            return (len(sources[0]), sum(p[0] for p in pieces), *pieces[0][1:])
        handle = self._handles[self._stored[key]]
        if isinstance(handle, dict):  # a memory-mapped .bin
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def _files(self) -> list[str]:
        return weight_files(self.folder)

    def _open(self, file: str):
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            return safe_open(str(self.folder / file), framework="pt", device="cpu")
        return torch.load(self.folder / file, map_location="cpu", mmap=True, weights_only=True)

    def key_for(self, name: str) -> str | None:
        return self._keys.get(name)

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        if key in self._merged:
            # Only the experts of the region are read, each whole (its pieces joined), then cut.
            sources = self._merged[key]
            experts = range(offset[0], offset[0] + shape[0])
            whole = [torch.cat([self.read(keys[e], (), ()) for keys in sources]) for e in experts]
            return torch.stack(whole)[(slice(None), *slice_of(offset[1:], shape[1:]))]
        handle = self._handles[self._stored[key]]
        if isinstance(handle, dict):  # a memory-mapped .bin
            return handle[key][slice_of(offset, shape)].clone()
        if len(offset) == 0:
            return handle.get_tensor(key)
        return handle.get_slice(key)[slice_of(offset, shape)]

    def close(self) -> None:
        self._handles.clear()


def weight_files(folder: Path) -> list[str]:
    """The weights files of a save_pretrained folder (the shards its index lists, or the one file)."""
    from accord.errors import UserInputError

    for weights in ("model.safetensors", "pytorch_model.bin"):
        index = folder / f"{weights}.index.json"
        if index.exists():
            try:
                return sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserInputError(
                    f"model.path: {index} is not a weights index ({type(e).__name__}: {e}); "
                    "re-save the folder with save_pretrained"
                ) from None
        if (folder / weights).exists():
            return [weights]
    raise UserInputError(f"model.path={folder}: no model.safetensors or pytorch_model.bin (or their index) in it")


def check_weight_files(folder: Path) -> list[str]:
    """Problems with a model folder's weights files, found by reading their headers only (a
    truncated or corrupt safetensors file fails here, before any worker starts)."""
    from safetensors import safe_open

    from accord.errors import UserInputError

    try:
        files = weight_files(folder)
    except UserInputError as e:
        return [str(e)]
    problems = []
    for file in files:
        path = folder / file
        try:
            if not path.is_file():
                raise FileNotFoundError("listed in the index but missing")
            if file.endswith(".safetensors"):
                # The header is checked against the file's size: a truncated file fails here.
                with safe_open(str(path), framework="numpy"):
                    pass
            else:
                torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # safetensors, zipfile and pickle raise many kinds; all mean "unreadable"
            reason = " ".join(str(e).split())[:200]
            problems.append(
                f"model.path: {path} cannot be read ({reason}); is it truncated (an interrupted copy or download)? "
                "copy it again"
            )
    return problems


def _rename(stored: dict[str, str], model: nn.Module) -> tuple[dict[str, str], dict[str, list[list[str]]]]:
    """Model tensor name (peft wrapping taken out) -> stored key, as from_pretrained maps them;
    and the tensors transformers builds from several stored ones (a mixture-of-experts layer's
    experts, stored one by one, fused into one 3-D parameter): name -> the stored keys of each
    source (gate, up, ...), expert by expert."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    base = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    names = {canonical_name(n) for n, _ in _named_tensors(model)}
    if base is None:
        return {k: k for k in stored if k in names}, {}
    transforms = get_model_conversion_mapping(base)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = {n: True for n in names}
    out: dict[str, str] = {}
    merged: dict[str, dict[int, dict[int, str]]] = {}
    for key in stored:
        target, pattern = rename_source_key(key, renamings, converters, base.base_model_prefix, meta_state)
        if pattern is not None:
            converter = next(c for c in converters if pattern in c.source_patterns)
            expert = _EXPERT_INDEX.search(key)
            if not _stacks_experts(converter) or expert is None:
                from accord.errors import UserInputError

                raise UserInputError(
                    f"model.path: {key!r} must be converted ({converter}) to load into {type(base).__name__}; "
                    f"sharded loading reads tensors as stored: re-save the folder with save_pretrained first"
                )
            if target in names:
                sources = merged.setdefault(target, {})
                sources.setdefault(converter.source_patterns.index(pattern), {})[int(expert.group(1))] = key
            continue
        if target in names:
            out[target] = key
    return out, {target: _expert_lists(target, sources) for target, sources in merged.items()}


# A stored expert's index in its name (mlp.experts.3.gate_proj.weight, block_sparse_moe.experts.3.w1.weight).
_EXPERT_INDEX = re.compile(r"experts\.(\d+)\.")


def _stacks_experts(converter) -> bool:
    """The conversions accord reads slice by slice: the experts stacked along a new first
    dimension, and then, for several sources, each expert's pieces joined along its first."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def _expert_lists(target: str, sources: dict[int, dict[int, str]]) -> list[list[str]]:
    lists = []
    for index in sorted(sources):
        by_expert = sources[index]
        if sorted(by_expert) != list(range(len(by_expert))):
            from accord.errors import UserInputError

            raise UserInputError(f"model.path: the experts stored for {target} are not numbered 0..N-1; re-save it")
        lists.append([by_expert[e] for e in range(len(by_expert))])
    return lists


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers()
