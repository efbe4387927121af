"""A mixture-of-experts router's load-balancing loss (and z-loss) over the whole global batch.

transformers' MoE models compute their balancing loss per forward (`load_balancing_loss_func`
over the router logits of that forward's tokens): with R router layers, T tokens and E experts,
f_e = Σ_layers (tokens routed to e) / (R·T), P_e = Σ_layers Σ_tokens p_e / (R·T) and
aux = E · Σ_e f_e · P_e. Averaged over micro-batches and processes, that is a different
objective for every split of the batch. Here (moe.balance_loss: global_batch) T counts every
real token of the global batch on every rank, as if one process ran it in one forward.

f_e carries no gradient, so once f and T are known the loss is a plain sum over tokens: a
micro-batch's share is E · Σ_e f_e · (its Σ p_e) / (R·T), exactly additive over micro-batches and
ranks. f and T are counted before the step's micro-batches, in a gradient-free pass over the
same rows (accord.run.batch_pass, the mechanism kto's KL estimate uses): one more forward per
step, and the routing counted is that of the forward that trains (same weights, same rows).
The z-loss (mean squared log-sum-exp of the router logits) is a sum over tokens already: each
micro-batch adds its sum / (R·T).

moe.balance_loss: per_forward keeps the model's own form (each forward's aux_loss, averaged
over the step's forwards); off trains without one. Either way the step's routing is logged.
"""

from __future__ import annotations

import torch
from torch import nn

from accord.distributed import group as dist
from accord.errors import UserInputError
from accord.models.moe import DEFAULT_AUX_LOSS_COEF, MoELayout, RouterCapture, RouterRecord, moe_layout, pretrained_part
from accord.recipe.moe import MoEConfig
from accord.tasks.base import TOKEN_MASK, LossOutput


def balance_loss(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' load_balancing_loss_func from its sums: `counts` and `prob_sums` layers ×
    experts, `tokens` per layer (their total is the R·T it divides by)."""
    total = tokens.sum().clamp(min=1)
    return counts.shape[-1] * ((counts.sum(0) / total) * (prob_sums.sum(0) / total)).sum()


class RouterStatistics:
    """The router sums of a whole global batch (or of one recording): layers × experts
    assignments and probabilities, per layer squared log-sum-exps and tokens (float64)."""

    def __init__(self, counts: torch.Tensor, prob_sums: torch.Tensor, lse_squares: torch.Tensor, tokens: torch.Tensor):
        self.counts, self.prob_sums, self.lse_squares, self.tokens = counts, prob_sums, lse_squares, tokens

    @classmethod
    def of(cls, record: RouterRecord) -> RouterStatistics:
        detached = (record.counts(), record.prob_sum().detach(), record.lse_square().detach(), record.tokens())
        return cls(*(value.double() for value in detached))

    def vector(self) -> torch.Tensor:
        return torch.cat([self.counts.flatten(), self.prob_sums.flatten(), self.lse_squares, self.tokens])

    @classmethod
    def from_vector(cls, vector: torch.Tensor, layout: MoELayout) -> RouterStatistics:
        n = layout.layers * layout.num_experts
        shape = (layout.layers, layout.num_experts)
        counts, probs = vector[:n].reshape(shape), vector[n : 2 * n].reshape(shape)
        return cls(counts, probs, vector[2 * n : 2 * n + layout.layers], vector[2 * n + layout.layers :])

    def __add__(self, other: RouterStatistics) -> RouterStatistics:
        return RouterStatistics.from_vector(self.vector() + other.vector(), self._layout())

    def _layout(self) -> MoELayout:
        return MoELayout(self.counts.shape[1], 1, self.counts.shape[0])

    def means(self) -> dict[str, float]:
        """The logged summary: the balancing loss of these sums, the z-loss, and how uneven the
        experts' loads are (max / mean tokens per expert: the worst layer's and the mean over layers)."""
        loads = self.counts / self.counts.mean(1, keepdim=True).clamp(min=1e-12)
        imbalance = loads.max(1).values
        return {
            "router_balance_loss": float(balance_loss(self.counts, self.prob_sums, self.tokens)),
            "router_z_loss": float(self.lse_squares.sum() / self.tokens.sum().clamp(min=1)),
            "router_imbalance": float(imbalance.max()),
            "router_imbalance_mean": float(imbalance.mean()),
            "router_idle_experts": float((self.counts == 0).sum()),
        }


class RouterBalancedTask:
    """A task whose micro-batch losses gain the router's balancing and z-loss; everything else
    is the task's own (evaluation scores the task's loss alone)."""

    def __init__(self, task, capture: RouterCapture, mode: str, aux_coef: float, z_coef: float, forwards: int):
        self._task = task
        self.capture, self.layout = capture, capture.layout
        self.mode, self.aux_coef, self.z_coef = mode, aux_coef, z_coef
        self.forwards = forwards  # micro-batches of a step over all ranks (per_forward averages over them)
        self.batch_statistics = mode == "global_batch"
        self._global: RouterStatistics | None = None  # this step's, from the gradient-free pass
        self._step: RouterStatistics | None = None  # this rank's, summed over the step's micro-batches
        self._step_aux = 0.0  # per_forward: this rank's summed aux_loss of its forwards

    def __getattr__(self, name: str):
        return getattr(self._task, name)

    def describe(self) -> list[str]:
        layout = self.layout
        shape = f"{layout.num_experts} experts, top-{layout.top_k}, {layout.layers} router layers"
        if self.mode == "off":
            what = "no balancing loss"
        else:
            where = "the whole global batch" if self.mode == "global_batch" else "each forward (the model's aux_loss)"
            what = f"balancing loss × {self.aux_coef:g} over {where}"
            what += f", z-loss × {self.z_coef:g}" if self.z_coef else ""
        return self._task.describe() + [f"router: {what} ({shape})"]

    # ------------------------------------------------------------ the gradient-free pass (global_batch)

    def statistics_batch(self, rows: list[list[dict]], partners: list[list[dict]]) -> dict[str, torch.Tensor]:
        return self._task.collate(rows)

    def statistics_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.capture.recording(batch.get(TOKEN_MASK)) as record:
            self._task.loss(model, batch)
        return RouterStatistics.of(record).vector()

    def use_statistics(self, totals: torch.Tensor) -> None:
        self._global = RouterStatistics.from_vector(totals.double(), self.layout)

    # ------------------------------------------------------------ the micro-batches

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        with self.capture.recording(batch.get(TOKEN_MASK)) as record:
            out = self._task.loss(model, batch)
        term = self._term(record)
        if term is not None:
            out.normalised_loss = term if out.normalised_loss is None else out.normalised_loss + term
        if self.mode != "global_batch":
            stats = RouterStatistics.of(record)
            self._step = stats if self._step is None else self._step + stats
            self._step_aux += float(balance_loss(stats.counts, stats.prob_sums, stats.tokens))
        return out

    def _term(self, record: RouterRecord) -> torch.Tensor | None:
        if self.mode == "off":
            return None
        prob_sums, lse_squares = record.prob_sum(), record.lse_square()
        if self.mode == "global_batch":
            assert self._global is not None, "the balancing loss needs the step's router statistics first"
            total = self._global.tokens.sum().clamp(min=1)
            fraction = (self._global.counts.sum(0) / total).to(prob_sums)  # f_e: a constant of the step
            aux = self.layout.num_experts * (fraction * prob_sums.sum(0)).sum() / total.item()
            z = lse_squares.sum() / total.item()
        else:
            counts, tokens = record.counts().to(prob_sums), record.tokens().to(prob_sums)
            aux = balance_loss(counts, prob_sums, tokens)
            z = lse_squares.sum() / tokens.sum().clamp(min=1)
            aux, z = aux / self.forwards, z / self.forwards
        return self.aux_coef * aux + self.z_coef * z if self.z_coef else self.aux_coef * aux

    def step_means(self) -> dict[str, float]:
        means = self._task.step_means()
        if self.mode == "global_batch":
            stats = self._global
        else:  # one reduction: the step's sums over the ranks, the forwards' aux_loss with them
            device = self.capture_device()
            aux = torch.tensor([self._step_aux], dtype=torch.float64, device=device)
            vector = dist.all_reduce_sum(torch.cat([self._step.vector().to(device), aux]))
            stats = RouterStatistics.from_vector(vector[:-1].cpu(), self.layout)
            means["router_aux_loss_per_forward"] = float(vector[-1]) / self.forwards
        self._step, self._step_aux, self._global = None, 0.0, None
        return means | (stats.means() if stats is not None else {})

    def capture_device(self) -> torch.device:
        """Where the process group reduces (gloo: the CPU; NCCL: the GPU)."""
        try:
            return next(self.capture.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")


def balance_router(task, model: nn.Module, cfg: MoEConfig, plan) -> object:
    """`task` with the router's balancing loss (the recipe's moe section, `cfg`) for a
    mixture-of-experts `model` (hooks installed on it); a dense model's task as it is."""
    layout = moe_layout(model)
    if layout is None:
        return task
    check_router_task(task, cfg.balance_loss)
    config = pretrained_part(model).config
    aux = cfg.aux_loss_coef
    if aux is None:
        aux = getattr(config, "router_aux_loss_coef", None)
        aux = DEFAULT_AUX_LOSS_COEF if aux is None else float(aux)
    z = cfg.z_loss_coef if cfg.z_loss_coef is not None else float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
    if hasattr(task, "marks_tokens"):
        task.marks_tokens = True
    forwards = plan.global_batch_size // plan.micro_batch_size
    return RouterBalancedTask(task, RouterCapture(model, layout), cfg.balance_loss, aux, z, forwards)


def check_router_task(task, mode: str) -> None:
    """moe.balance_loss=global_batch needs the step's rows before its micro-batches, as collated for training."""
    if mode != "global_batch":
        return
    if task.online or task.batch_statistics:
        kind = "samples its batches online" if task.online else "runs its own pass over the global batch"
        raise UserInputError(
            f"moe.balance_loss=global_batch with task {task.name} is not supported yet (the task {kind}); "
            "set moe.balance_loss=per_forward or off"
        )
