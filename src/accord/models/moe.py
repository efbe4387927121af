"""Mixture-of-experts models: how many experts they route to, which modules route, and what
those modules routed in the forwards a caller asks about.

transformers' MoE families (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GPT-OSS, ...) compute their
balancing `aux_loss` inside each forward from `output_router_logits`; accord hooks the same
router modules instead (accord.compat.transformers.router_output), so a task's forwards of a
micro batch yield the router statistics that accord.tasks.router_balance turns into a loss over
the whole global batch. The statistics are those of transformers' `load_balancing_loss_func`:
per router layer and expert, the top-k assignments (no gradient) and the summed softmax
probabilities, over the tokens that are not padding; and the squared log-sum-exp of the logits
for the z-loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from accord.compat.transformers import router_output, text_config

# Config fields naming the routed experts and the experts each token goes to, across families.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
DEFAULT_AUX_LOSS_COEF = 0.001  # transformers' default router_aux_loss_coef (Mixtral, Qwen3-MoE, OLMoE)


def config_experts(config) -> int:
    """Routed experts per MoE layer of a transformers config (0: a dense model)."""
    config = text_config(config)
    for key in _EXPERT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def config_top_k(config) -> int:
    config = text_config(config)
    for key in _TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


@dataclass(frozen=True)
class MoELayout:
    num_experts: int
    top_k: int
    layers: int  # router modules (MoE layers; a model may interleave dense ones)


def pretrained_part(model: nn.Module) -> nn.Module:
    """The transformers model inside `model` (itself, or under peft's or an engine's wrapper)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return model


def routers(model: nn.Module) -> tuple[list[nn.Module], int]:
    """The router modules of `model` in layer order, and the index of the router logits in their output."""
    inner = pretrained_part(model)
    found = router_output(inner)
    if found is None:
        return [], 0
    is_router, index = found
    return [m for m in inner.modules() if is_router(m)], index


def moe_layout(model: nn.Module) -> MoELayout | None:
    """The model's experts and router layers (None: not a mixture-of-experts model accord can balance)."""
    inner = pretrained_part(model)
    experts = config_experts(getattr(inner, "config", None))
    modules, _ = routers(inner)
    if experts == 0 or not modules:
        return None
    return MoELayout(experts, config_top_k(inner.config), len(modules))


def idle_expert_parameters(model: nn.Module) -> int:
    """Parameters of the routed experts a token does not go to: (1 - top_k / experts) of the
    fused 3-D expert weights (0 for a dense model), left out of the training FLOPs per token."""
    layout = moe_layout(model)
    if layout is None:
        return 0
    fused = sum(p.numel() for p in model.parameters() if p.dim() == 3 and p.shape[0] == layout.num_experts)
    return int(fused * (1 - layout.top_k / layout.num_experts))


class RouterRecord:
    """What the routers did in the forwards of one recording, per router layer: top-k
    assignments and tokens (float64, no gradient), and the fp32 sums the losses are made of
    (with the graph back to the routers)."""

    def __init__(self, layout: MoELayout, token_mask: torch.Tensor | None):
        self.layout = layout
        self.token_mask = token_mask  # the batch's real tokens where its attention mask cannot say (4-D masks)
        self.forward_mask: torch.Tensor | None = None  # of the model forward now running
        empty: list[torch.Tensor | None] = [None] * layout.layers
        self._counts, self._tokens, self._probs, self._lse = list(empty), list(empty), list(empty), list(empty)

    def add(self, layer: int, logits: torch.Tensor) -> None:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        mask = self.forward_mask
        if mask is not None and mask.numel() != logits.shape[0]:
            raise RuntimeError(
                f"router layer {layer} routed {logits.shape[0]} tokens, the batch's mask covers {mask.numel()}"
            )
        # Under activation checkpointing this runs inside the checkpointed layer, whose saved-tensor
        # hooks would count what these ops save; the recomputation (outside a recording) does not
        # run them, and the counts would differ. Kept as plain saved tensors instead.
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            self._add(layer, logits, mask)

    def _add(self, layer: int, logits: torch.Tensor, mask: torch.Tensor | None) -> None:
        weight = torch.ones(logits.shape[0], device=logits.device) if mask is None else mask.to(logits.device).float()
        probs = torch.softmax(logits, dim=-1)
        with torch.no_grad():
            chosen = torch.topk(probs, self.layout.top_k, dim=-1).indices
            counts = torch.zeros(self.layout.num_experts, dtype=torch.float64, device=logits.device)
            counts.scatter_add_(0, chosen.reshape(-1), weight.double().repeat_interleave(self.layout.top_k))
            self._counts[layer] = _plus(self._counts[layer], counts)
            self._tokens[layer] = _plus(self._tokens[layer], weight.double().sum())
        self._probs[layer] = _plus(self._probs[layer], (probs * weight[:, None]).sum(0))
        self._lse[layer] = _plus(self._lse[layer], (torch.logsumexp(logits, dim=-1).square() * weight).sum())

    def counts(self) -> torch.Tensor:
        """Layers × experts: top-k assignments of the real tokens (float64)."""
        return self._stacked(self._counts, (self.layout.num_experts,), torch.float64)

    def tokens(self) -> torch.Tensor:
        """Per layer, the real tokens routed (float64)."""
        return self._stacked(self._tokens, (), torch.float64)

    def prob_sum(self) -> torch.Tensor:
        """Layers × experts: the summed router probabilities (fp32, with their graph)."""
        return self._stacked(self._probs, (self.layout.num_experts,), torch.float32)

    def lse_square(self) -> torch.Tensor:
        """Per layer, the summed squared log-sum-exp of the router logits (fp32, with their graph)."""
        return self._stacked(self._lse, (), torch.float32)

    def _stacked(self, values: list[torch.Tensor | None], shape: tuple[int, ...], dtype) -> torch.Tensor:
        # A layer no forward reached in this recording adds nothing.
        device = next((v.device for v in values if v is not None), torch.device("cpu"))
        return torch.stack([v if v is not None else torch.zeros(shape, dtype=dtype, device=device) for v in values])


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _plus(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value if total is None else total + value


class RouterCapture:
    """Forward hooks on a model's routers that fill a RouterRecord while one is open; outside
    `recording()` (evaluation, generation, activation checkpointing's recomputation in backward)
    they record nothing."""

    def __init__(self, model: nn.Module, layout: MoELayout):
        self.layout = layout
        self.model = pretrained_part(model)
        self.routers, self.index = routers(self.model)
        self.record: RouterRecord | None = None
        self.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        for layer, module in enumerate(self.routers):
            module.register_forward_hook(self._router_hook(layer))

    @contextlib.contextmanager
    def recording(self, token_mask: torch.Tensor | None = None) -> Iterator[RouterRecord]:
        record = RouterRecord(self.layout, token_mask)
        self.record = record
        try:
            yield record
        finally:
            self.record = None

    def _before_forward(self, module, args, kwargs):
        # A copy of the model (a frozen reference policy) carries the hooks too: only this model counts.
        if self.record is None or module is not self.model:
            return None
        self.record.forward_mask = self._token_mask(kwargs.get("attention_mask"))
        return None

    def _token_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is None or attention_mask.numel() == 0:
            # Every token counts: full rows, or a flattened micro-batch (accord.models.documents'
            # empty placeholder mask), which holds no padding.
            return None
        if attention_mask.dim() == 2:
            return attention_mask.reshape(-1).bool()
        if self.record.token_mask is not None:
            return self.record.token_mask.reshape(-1).bool()
        raise RuntimeError("a 4-D attention mask without the batch's token mask: padding cannot be told apart")

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            if self.record is None or module is not self.routers[layer]:
                return
            logits = output[self.index] if isinstance(output, (tuple, list)) else output
            self.record.add(layer, logits)

        return hook
