"""One optimizer step of the RL algorithm over a batch of groups, on one rank or several
(DDP, or FSDP2 shards)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipelinerl.config import Config, EngineConfig, LossConfig, TrainerConfig
from pipelinerl.rl.advantages import groups_advantages, is_truncated
from pipelinerl.rl.capture import Capture
from pipelinerl.rl.compute import computing
from pipelinerl.rl.losses import (
    SUMS,
    LossStats,
    gspo_loss,
    importance_mask,
    length_bins,
    ppo_clip_active,
    ppo_clip_loss,
    reference_k3,
    reinforce_tis_loss,
    tis_clip_active,
)
from pipelinerl.rl.packing import PackedBatch, pack, pad
from pipelinerl.rl.parallel import decoder_layers, idle_pass, is_sharded
from pipelinerl.rl.scores import ScoreMode, TokenScores, score_tokens
from pipelinerl.types import Group, Sample

log = logging.getLogger(__name__)

# (temperature, top_k, top_p) the trainer scores tokens under.
Scoring = tuple[float, int, float]


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Group],
    cfg: Config,
    trainer_version: int,
    num_sequences: int | None = None,
    ref_model: torch.nn.Module | None = None,
    keep_groups: int = 0,
) -> dict[str, Any]:
    """Advantages, micro-batched loss and backward, gradient clipping, optimizer step.

    `groups` is this rank's shard; `num_sequences` the number of samples in the whole step
    across ranks (B in the loss), None: counted, every rank's summed (an episode that branched
    is one sample per branch, so a step may hold more than `trainer.batch_size`). `model` may
    be wrapped in DistributedDataParallel (its gradients all-reduced once, on the last
    micro-batch) or sharded by FSDP2 (every rank runs as many micro-batch passes as the
    busiest: each pass gathers weights). `ref_model`: the frozen reference of
    `trainer.loss.kl_coef` (needed when it is > 0). Returns the step's metrics: loss, grad
    norm, `samples` (B), and `LossStats` (ESS, lag, mismatch) over every trained token of
    every rank. `keep_groups`: the first so many of `groups` come back as `scored`, what the
    step computed for each of their samples (`pipelinerl.rl.capture.Capture`, one copy to the host).
    The forward and backward run in `trainer.precision`, on `trainer.compute_dtype` weights,
    with `trainer.compile`'s compiled layers and loss or `trainer.liger`'s fused kernels.
    One rank's step reads the device twice: its sums and gradient norm before the optimizer's
    step, its statistics after it (tests/test_launch_budgets.py).
    """
    if cfg.trainer.compile:
        compile_layers(model)
    with arithmetic(cfg.trainer.precision, next(model.parameters()).device):
        return _step(model, optimizer, groups, cfg, trainer_version, num_sequences, ref_model,
                     keep_groups)


def compile_layers(model: torch.nn.Module) -> None:
    """`trainer.compile`: each decoder layer under torch.compile, in place (the parameters'
    names unchanged), sequence lengths dynamic: one graph for every length, no recompilation
    per step. The attention of packed rows runs eagerly between the compiled parts
    (`rl.attention`): one varlen flash-attention call on CUDA, its sequences' lengths host
    ints. Once per model."""
    for layer in decoder_layers(getattr(model, "module", model)):
        if layer._compiled_call_impl is None:
            layer.compile(dynamic=True)


def score_mode(tc: TrainerConfig) -> ScoreMode:
    """How the step computes its log-probs: `rl.scores.ScoreMode`."""
    return "liger" if tc.liger else "compiled" if tc.compile else "eager"


@contextlib.contextmanager
def arithmetic(precision: str, device: torch.device) -> Iterator[None]:
    """`trainer.precision`: bfloat16 autocast (weights, gradients and AdamW stay float32), TF32
    CUDA matmuls, or plain float32."""
    if precision == "tf32":
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")  # TF32 on CUDA's tensor cores
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        yield


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[Group],
          cfg: Config, trainer_version: int, num_sequences: int | None,
          ref_model: torch.nn.Module | None, keep_groups: int) -> dict[str, Any]:
    tc = cfg.trainer
    loss_cfg = tc.loss
    if loss_cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("trainer.loss.kl_coef > 0 needs the reference model (ref_model)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = next(model.parameters()).device
    samples = [s for g in groups for s in g.samples]
    trained_idx = _trained_indices(samples, loss_cfg)
    capture = None
    if keep_groups:
        capture = Capture([s for g in groups[:keep_groups] for s in g.samples], trained_idx)
    stats = LossStats(lag_range=_lag_range([samples[i] for i in trained_idx], trainer_version))
    optimizer.zero_grad(set_to_none=True)
    with computing(model, tc.compute_dtype):
        passes = _forward_backward(model, groups, cfg, trainer_version, num_sequences,
                                   ref_model, stats, capture, world, device)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    if isinstance(grad_norm, DTensor):  # sharded gradients: the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    # The step's one read of its sums before the optimizer's step (the non-finite check
    # needs the norm on the host); LossStats' sums are read once more, after it.
    values = torch.stack([passes.loss_sum, passes.masked_sum, passes.kl_sum,
                          grad_norm.to(torch.float64)]).tolist()
    totals = dict(zip(("loss", "is_masked", "kl_ref"), values[:3]))
    totals["input_tokens"] = float(passes.input_tokens)
    norm = values[3]
    lr_scale = _sequence_ess(passes.log_weights) ** 0.5 if loss_cfg.ess_lr_scale else 1.0
    # A non-finite gradient (the norm is over the synced gradients: every rank agrees) would
    # write NaN into the weights and Adam's moments for good: the step is skipped, counted.
    finite = math.isfinite(norm)
    if finite:
        with _scaled_lr(optimizer, lr_scale):
            optimizer.step()
    else:
        log.warning("non-finite gradient norm (loss %s) at trainer version %d: optimizer step "
                    "skipped, the weights are unchanged", totals["loss"], trainer_version)
        optimizer.zero_grad(set_to_none=True)
    if world > 1:
        stats, totals = _reduce(stats, totals, device)
    metrics = stats.finalize()
    tokens = max(1.0, metrics["tokens"])
    return {
        "loss": totals["loss"],
        "grad_norm": norm,
        "skipped_nonfinite": int(not finite),
        "input_tokens": int(totals["input_tokens"]),
        "samples": passes.num_samples,
        "lr": optimizer.param_groups[0]["lr"],
        **metrics,
        **({"is_mask_frac": totals["is_masked"] / tokens} if loss_cfg.is_mask is not None else {}),
        **({"kl_ref": totals["kl_ref"] / tokens} if loss_cfg.kl_coef > 0 else {}),
        **({"vcpo_lr_scale": lr_scale} if loss_cfg.ess_lr_scale else {}),
        **({"scored": capture.scored()} if capture is not None else {}),
    }


@dataclass
class _Passes:
    """What the step's forward and backward passes leave for the optimizer's part: sums on
    the device, read once."""

    loss_sum: torch.Tensor
    masked_sum: torch.Tensor
    kl_sum: torch.Tensor
    log_weights: torch.Tensor  # per sequence, log w (trainer.loss.ess_lr_scale)
    input_tokens: int
    num_samples: int


def _forward_backward(model: torch.nn.Module, groups: list[Group], cfg: Config,
                      trainer_version: int, num_sequences: int | None,
                      ref_model: torch.nn.Module | None, stats: LossStats,
                      capture: Capture | None, world: int, device: torch.device) -> _Passes:
    """Advantages, then each micro-batch's loss and backward, its statistics into `stats`
    (and `capture`): the gradients of the whole step in the parameters' `.grad`."""
    tc = cfg.trainer
    loss_cfg = tc.loss
    scoring = _scoring(cfg.engine)
    mode = score_mode(tc)
    batches, trained = _batches_with_advantages(model, groups, tc, scoring, device, mode)
    if loss_cfg.kind == "reinforce":
        clip_active = tis_clip_active(loss_cfg.is_clip)
    else:
        clip_active = ppo_clip_active(loss_cfg.eps_low, loss_cfg.eps_high)
    bins = length_bins(torch.tensor([len(s.token_ids) for s in trained], dtype=torch.long)).to(device)
    stats.count_sequences(bins)
    # Summed on the device and read once after the loop: a GPU step waits for no micro-batch.
    loss_sum, masked_sum, kl_sum = (torch.zeros((), dtype=torch.float64, device=device)
                                    for _ in range(3))
    input_tokens = 0
    step_log_weights = torch.zeros(sum(b.num_sequences for b in batches), dtype=torch.float64,
                                   device=device)
    counted, num_tokens = _step_counts(groups, batches, device)
    num_samples = num_sequences or counted
    # The loss's denominator, one constant for the whole step: B, or (token_mean) its tokens.
    normalizer = float(num_samples if loss_cfg.aggregate == "sum_per_sequence"
                       else max(1, num_tokens))
    if not batches and world > 1 and not is_sharded(model):
        idle_pass(model, device, backward=True)  # DDP's gradient all-reduce waits for every rank
    for _ in range(len(batches), _passes(model, len(batches), device)):
        _idle_micro_batch(model, ref_model, device)
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        # DDP averages gradients over ranks; the loss is a sum over the whole step, so each
        # rank's part is scaled back up by the world size.
        is_last = i == len(batches) - 1
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            scores = score_tokens(model, batch, *scoring, entropy_grad=loss_cfg.entropy_coef > 0,
                                  mode=mode)
            new_lp = scores.logprobs
            mask = None
            if loss_cfg.is_mask is not None:
                mask = importance_mask(new_lp, batch.old_logprobs, *loss_cfg.is_mask)
                masked_sum += (~mask).sum()
            loss = _policy_loss(loss_cfg, new_lp, batch, normalizer, mask)
            loss, k3_sum = _regularized(loss, loss_cfg, scores, batch, normalizer, ref_model,
                                        scoring, mode)
            kl_sum += k3_sum
            (loss * world).backward()
        loss_sum += loss.detach()
        input_tokens += batch.num_input_tokens
        if loss_cfg.ess_lr_scale:
            _add_log_weights(step_log_weights, batch, new_lp)
        if capture is not None:
            capture.add(batches[i], new_lp)  # the host batch: its seq_idx read without a sync
        stats.add(new_lp, batch.old_logprobs, batch.advantages, batch.versions, trainer_version,
                  clip_active, entropy=scores.entropy, context_versions=batch.context_versions,
                  bins=bins[batch.seq_idx])
    return _Passes(loss_sum, masked_sum, kl_sum, step_log_weights, input_tokens, num_samples)


def _lag_range(samples: list[Sample], trainer_version: int) -> tuple[int, int] | None:
    """The lowest and highest lag among the samples' tokens, from the host's versions (so the
    lag histogram needs no read of the device); None without a token."""
    versions = [v for s in samples for v in (min(s.versions), max(s.versions)) if s.versions]
    if not versions:
        return None
    return trainer_version - max(versions), trainer_version - min(versions)


def _passes(model: torch.nn.Module, n: int, device: torch.device) -> int:
    """How many micro-batch passes this rank runs: its own `n`, or with a sharded model the
    most any rank has, since every forward pass gathers weights from every rank."""
    if not is_sharded(model) or not dist.is_initialized():
        return n
    most = torch.tensor([n], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _idle_micro_batch(model: torch.nn.Module, ref_model: torch.nn.Module | None,
                      device: torch.device) -> None:
    """A sharded rank out of micro-batches runs the collectives of one more, in a real one's
    order: the model's forward, the reference's (when the KL penalty uses it), the backward."""
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    logits = model(input_ids=token, use_cache=False).logits
    if ref_model is not None:
        idle_pass(ref_model, device, backward=False)
    (logits.sum() * 0.0).backward()


def _scoring(ec: EngineConfig) -> Scoring:
    """Score under the distribution the engine sampled from: logits / T, truncated to top-k and
    top-p (`engine.sampling`). Greedy (T = 0) is scored at T = 1, untruncated, as reported."""
    if ec.temperature > 0:
        return ec.temperature, ec.top_k, ec.top_p
    return 1.0, 0, 1.0


def _batches_with_advantages(model: torch.nn.Module, groups: list[Group], tc: TrainerConfig,
                             scoring: Scoring, device: torch.device, mode: ScoreMode
                             ) -> tuple[list[PackedBatch], list[Sample]]:
    """The step's micro-batches of trained samples, each token with its sequence's advantage,
    and those samples (the order the batches' `seq_idx` indexes).

    The advantages are attached once the batches exist: the vcpo baseline needs each
    sequence's importance weight, hence a scoring pass over the batches the loss will use.
    """
    samples = [s for g in groups for s in g.samples]
    trained = _trained_indices(samples, tc.loss)
    trained_samples = [samples[i] for i in trained]
    batches = _batches(trained_samples, tc)
    log_weights = None
    if tc.advantage.baseline == "vcpo":
        # An untrained sample (empty completion, or masked) keeps log w = 0: w = 1.
        log_weights = torch.zeros(len(samples), dtype=torch.float64)
        log_weights[trained] = _sequence_log_weights(model, batches, len(trained), scoring, device,
                                                     mode)
    advantages = groups_advantages(
        groups, tc.advantage.baseline, tc.advantage.std_normalize,
        truncated=tc.loss.truncated, truncated_reward=tc.loss.truncated_reward,
        log_weights=log_weights,
    )[trained]
    return [replace(b, advantages=advantages[b.seq_idx]) for b in batches], trained_samples


def _trained_indices(samples: list[Sample], loss_cfg: LossConfig) -> list[int]:
    """The samples with tokens to train: a completion, and not masked as truncated."""
    masked = loss_cfg.truncated == "mask"
    return [i for i, s in enumerate(samples) if s.token_ids and not (masked and is_truncated(s))]


def _batches(samples: list[Sample], tc: TrainerConfig) -> list[PackedBatch]:
    """Micro-batches of `samples`, advantages still 0 (seq_idx indexes `samples`): packed rows
    of `max_tokens_per_row`, or with `tokens_per_microbatch` one varlen row of up to that many
    tokens a forward."""
    zeros = [0.0] * len(samples)  # host floats: the packer reads no tensor
    if tc.packing:
        return pack(samples, zeros, tc.tokens_per_microbatch or tc.max_tokens_per_row)
    return pad(samples, zeros, tc.max_tokens_per_row)


def _regularized(loss: torch.Tensor, loss_cfg: LossConfig, scores: TokenScores,
                 batch: PackedBatch, normalizer: float, ref_model: torch.nn.Module | None,
                 scoring: Scoring, mode: ScoreMode) -> tuple[torch.Tensor, torch.Tensor | float]:
    """The micro-batch's loss with the entropy bonus and the KL penalty (each only when its
    coefficient is > 0, on every trained token), and its sum of k3 (0 without the penalty)."""
    if loss_cfg.entropy_coef > 0:
        assert scores.entropy is not None  # the fused head, which has none, refuses a bonus
        loss = loss - loss_cfg.entropy_coef * scores.entropy.sum() / normalizer
    if loss_cfg.kl_coef == 0:
        return loss, 0.0
    k3 = reference_k3(scores.logprobs, _reference_logprobs(ref_model, batch, scoring, mode))
    return loss + loss_cfg.kl_coef * k3.sum() / normalizer, k3.detach().sum()


def _add_log_weights(log_weights: torch.Tensor, batch: PackedBatch, new_lp: torch.Tensor) -> None:
    """Add each token's log rho = log pi - log mu to its sequence's log importance weight."""
    log_rho = (new_lp.detach() - batch.old_logprobs).double()
    log_weights.index_add_(0, batch.seq_idx, log_rho)


@torch.no_grad()
def _sequence_log_weights(model: torch.nn.Module, batches: list[PackedBatch], n: int,
                          scoring: Scoring, device: torch.device, mode: ScoreMode
                          ) -> torch.Tensor:
    """log w_i = sum over sequence i's tokens of log pi - log mu, under the weights about to be
    trained, from a pass without a graph (the DDP wrapper skipped: nothing to synchronise)."""
    module = getattr(model, "module", model)
    log_weights = torch.zeros(n, dtype=torch.float64, device=device)
    for batch in batches:
        batch = batch.to(device)
        _add_log_weights(log_weights, batch,
                         score_tokens(module, batch, *scoring, mode=mode).logprobs)
    for _ in range(len(batches), _passes(model, len(batches), device)):
        idle_pass(module, device, backward=False)
    return log_weights.cpu()


@torch.no_grad()
def _reference_logprobs(ref_model: torch.nn.Module, batch: PackedBatch, scoring: Scoring,
                        mode: ScoreMode) -> torch.Tensor:
    return score_tokens(ref_model, batch, *scoring, mode=mode).logprobs


def _sequence_ess(log_weights: torch.Tensor) -> float:
    """Kong's normalised ESS (sum w)^2 / (N sum w^2) of the step's N sequence weights, over
    every rank; 1 with no sequence. Exact for any spread of log w: the weights are divided by
    the largest (ESS is scale-free) before exp, so none overflows."""
    top = log_weights.max().reshape(1) if log_weights.numel() else (
        torch.full((1,), float("-inf"), dtype=torch.float64, device=log_weights.device))
    if dist.is_initialized():
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    w = torch.exp(log_weights - top)
    sums = torch.stack([w.sum(), w.square().sum(), w.new_tensor(float(w.numel()))])
    if dist.is_initialized():
        dist.all_reduce(sums)
    total, total_sq, n = sums.tolist()
    return total**2 / (n * total_sq) if n else 1.0


@contextlib.contextmanager
def _scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every param group's lr times `scale` for the duration, then restored exactly, so the lr
    scheduler never sees the scaling."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


def _step_counts(groups: list[Group], batches: list[PackedBatch], device: torch.device
                 ) -> tuple[int, int]:
    """The step's samples (each branch of an episode one; untrained ones too) and trained
    tokens, summed over every rank before any backward: the candidates for the loss's
    denominator, one constant for the whole step. Summed, not taken from `trainer.batch_size`:
    ranks get whole groups, and a group with a branched episode holds more samples."""
    samples, tokens = sum(len(g.samples) for g in groups), sum(b.num_tokens for b in batches)
    if not dist.is_initialized():  # host ints: no device round trip (a GPU sync) for one rank
        return samples, tokens
    counts = torch.tensor([float(samples), float(tokens)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    samples, tokens = counts.tolist()
    return int(samples), int(tokens)


def _policy_loss(loss_cfg: LossConfig, new_lp: torch.Tensor, batch: PackedBatch,
                 normalizer: float, mask: torch.Tensor | None) -> torch.Tensor:
    old, adv = batch.old_logprobs, batch.advantages
    if loss_cfg.kind == "reinforce":
        return reinforce_tis_loss(new_lp, old, adv, normalizer, clip_c=loss_cfg.is_clip, mask=mask)
    if loss_cfg.kind == "ppo":
        return ppo_clip_loss(new_lp, old, adv, normalizer, eps=loss_cfg.eps_low, mask=mask,
                             eps_high=loss_cfg.eps_high)
    return gspo_loss(new_lp, old, adv, batch.seq_idx, normalizer, eps=loss_cfg.eps_low,
                     mask=mask, eps_high=loss_cfg.eps_high)


def _reduce(stats: LossStats, totals: dict[str, float], device: torch.device
            ) -> tuple[LossStats, dict[str, float]]:
    """Sum the step's statistics over ranks, the lag histogram bin by bin."""
    keys = list(totals)
    stats.allocate(device)
    summed = torch.cat([stats.sums.to(device),
                        torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=device)])
    dist.all_reduce(summed)
    by_length = stats.by_length.to(device)
    dist.all_reduce(by_length)
    lo, dense = _reduce_histogram(stats.lag_counts(), device)
    out = LossStats(sums=summed[:len(SUMS)], by_length=by_length,
                    lag_range=None if dense is None else (lo, lo + dense.numel() - 1),
                    lag_hist=dense)
    return out, dict(zip(keys, summed[len(SUMS):].tolist()))


def _reduce_histogram(counts: dict[int, int], device: torch.device
                      ) -> tuple[int, torch.Tensor | None]:
    """Sum {lag: count} over ranks: agree on the range of lags seen, then add dense bins;
    (lowest lag, its counts upward), None without a token on any rank."""
    # (max, -min); a rank with no token reports -inf so it does not widen the range.
    bounds = torch.tensor([max(counts), -min(counts)] if counts else [float("-inf")] * 2,
                          dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if not torch.isfinite(bounds).all():
        return 0, None
    lo, hi = -int(bounds[1].item()), int(bounds[0].item())
    dense = torch.zeros(hi - lo + 1, dtype=torch.float64, device=device)
    for lag, n in counts.items():
        dense[lag - lo] = n
    dist.all_reduce(dense)
    return lo, dense
