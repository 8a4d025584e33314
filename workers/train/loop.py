"""The training loop, written once: ``tlab run --local`` runs it in this process, Ray Train on every rank.

``train(spec, ctx)`` reads top to bottom: seed, data, model, optimizer; optional warm-up steps;
then per epoch (paper, Algorithm 1) teleport on ``teleport.batches`` random batches if the epoch
is scheduled, one epoch of the primary optimizer, and an evaluation. Every record goes to
``ctx.sink``:

- ``{"kind": "start", ...}`` once: dataset, model, parameter count, the spec;
- ``{"kind": "teleport", "epoch", "batch", **TeleportReport.to_dict()}`` per teleport batch, and
  ``{"kind": "budget", ...}`` when ``teleport.budget`` cut an epoch's teleport short (``workers.train.teleporting``);
- ``{"kind": "epoch", "epoch", "train_loss", "test_loss", "test_acc" (classification),
  "test_ppl" (lm), "seconds", "teleport_seconds"}`` per epoch (times are cumulative; both losses are means over
  samples, the train loss over the epoch's steps as they went; ``lr``, ``grad_norm``, ``clipped``:
  ``workers.train.stepping``);
- ``{"kind": "error", ...}`` before ``TrainingDiverged`` is raised; ``{"kind": "summary", ...}`` last.

``run_local(spec, out_dir)`` wraps it for one process: ``DIR/metrics.jsonl``, ``DIR/summary.json``
and ``DIR/curves.png``.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from api_schemas import ExperimentSpec
from workers.train.budget import TeleportBudget
from workers.train.build import (
    autocast,
    basis_executor,
    build_optimizer,
    build_parts,
    num_threads,
    reset_optimizer_state,
    seed_everything,
    select_device,
    select_dtype,
    teleport_config,
)
from workers.train.context import RunContext
from workers.train.gpu_share import device_report, gpu_memory
from workers.train.own_loop import run_own_loop
from workers.train.shared import TrainingDiverged, diverged, param_count, summarize
from workers.train.sinks import JsonlSink, MemorySink, MetricSink, SaySink, TeeSink
from workers.train.stepping import Stepper, accumulated, epoch_length
from workers.train.teleport_hints import schedule_hint
from workers.train.teleporting import TeleportDiverged, TeleportRunner, sample_batch, to_device

__all__ = ["TrainingDiverged", "evaluate", "param_count", "run_local", "sample_batch", "summarize", "to_device",
           "train"]

WARMUP_EPOCH = 1_000_000  # loader seed offset for warm-up passes, apart from the epochs' own


def _finite(value: float) -> bool:
    return math.isfinite(value)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, loss_fn: Any, task: str, ctx: RunContext,
             dtype: torch.dtype) -> dict[str, float]:
    """Sample-weighted mean test loss (all ranks' shards), accuracy for classification, perplexity for lm."""
    was_training = model.training
    model.eval()
    total, count, correct = 0.0, 0.0, 0.0
    for batch in loader:
        x, y = to_device(batch, ctx.device, dtype)
        out = model(x)  # (B, C), (B, D) or (B, T, V)
        total += float(loss_fn(out, y)) * y.shape[0]
        count += y.shape[0]
        if task == "classification":
            correct += float((out.argmax(dim=-1) == y).sum())
    model.train(was_training)
    total, count, correct = ctx.all_reduce_sum([total, count, correct])
    if count == 0:
        raise ValueError("the test set is empty: raise dataset.max_test or dataset.test_fraction")
    metrics = {"test_loss": total / count}
    if task == "classification":
        metrics["test_acc"] = correct / count
    if task == "lm":
        metrics["test_ppl"] = math.exp(min(metrics["test_loss"], 700.0))
    return metrics


# ------------------------------------------------------------------------ the loop


def train(spec: ExperimentSpec, ctx: RunContext | None = None, *, progress: bool = False,
          threads: int | None = None) -> dict[str, Any]:
    """Train ``spec`` under ``ctx`` (this process by default); returns the summary (see ``summarize``).
    ``threads``: torch threads while it trains (default ``resources.cpus_per_worker``, see ``num_threads``;
    0 keeps the process's own): every runner (in-process, a job's driver, a gang's rank, a Ray Train
    worker, a Tune trial) trains with the threads its CPUs pay for, whatever ``OMP_NUM_THREADS`` it inherited."""
    threads = num_threads(spec.resources) if threads is None else threads
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    ctx = ctx or RunContext(device=select_device(spec.training))
    try:
        summary = _train(spec, ctx, progress)
    except BaseException:
        try:  # what was saved before the failure is on disk; the failure is what the caller hears of
            ctx.flush()
        except Exception:  # noqa: BLE001 - a second error (the disk is full) must not hide the first
            traceback.print_exc()
        raise
    else:
        ctx.flush()  # every checkpoint written before the summary goes back
        return summary
    finally:
        torch.set_num_threads(before)


def _train(spec: ExperimentSpec, ctx: RunContext, progress: bool) -> dict[str, Any]:
    if spec.training.entrypoint:  # the user's own loop replaces this one (same context, same events)
        return run_own_loop(spec, ctx)
    tr, tp = spec.training, spec.teleport
    dtype = select_dtype(tr)

    # -- setup: everything seeded, so a seed fixes the init, the batches and the teleport batches
    seed_everything(tr.seed)
    data, model, loss_fn = build_parts(spec, ctx.sink, tr.seed)  # built-in or the user's factories
    model = model.to(dtype=dtype)  # the bare module: teleport moves it
    state = ctx.restore()  # a Ray worker restarted after a failure resumes from its last epoch
    if state is not None:
        model.load_state_dict(state["model"])
    net = ctx.prepare_model(model)  # what the optimizer steps through (DDP-wrapped on Ray)
    no_sync = getattr(net, "no_sync", contextlib.nullcontext)  # DDP: forward + backward whose gradients wait
    optimizer = build_optimizer(spec.optimizer, net.parameters())
    executor = basis_executor(tp) if tp.enabled and tp.method == "nullspace" else None
    teleport_epochs = set(tp.epochs) if tp.enabled else set()
    # held-out samples: teleport keeps the loss on its own batch only, this shows the drift elsewhere
    g = torch.Generator().manual_seed(tr.seed)
    holdout_idx = torch.randperm(len(data.test), generator=g)[: min(tp.batch_size, len(data.test))]
    holdout = to_device(sample_batch(data.test, holdout_idx), ctx.device, dtype)
    teleporter = TeleportRunner(tp, teleport_config(tp), ctx, dtype, TeleportBudget(tp.budget, tr.epochs), executor)
    if teleport_epochs and teleporter.sharded and tp.batch_size < ctx.world_size:
        raise ValueError(f"teleport.batch_size={tp.batch_size} is below resources.workers={ctx.world_size}: "
                         "every rank needs a share of the teleport batch")

    start_epoch, history, seconds, tele_seconds, tele_batches = 0, [], 0.0, 0.0, 0
    if state is not None:
        spec_groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        # the spec's hyperparameters win over the checkpoint's (a PBT trial goes on with mutated ones)
        for group, wanted in zip(optimizer.param_groups, spec_groups, strict=True):
            group.update(wanted)
        start_epoch, history, seconds = state["epoch"], state["history"], state["seconds"]
        tele_seconds, tele_batches = state["teleport_seconds"], state["teleport_batches"]
        teleporter.restore(state.get("teleport_budget"))
    epoch_batches, epoch_steps = epoch_length(len(data.train), tr.batch_size, ctx.world_size, tr.max_steps_per_epoch,
                                              tr.grad_accumulation)
    # the schedule goes on from this run's own step count at its start epoch: a checkpoint of the same run kept that
    # count; a fork or a PBT trial whose epochs have other steps (batch size, workers, accumulation) goes on from the
    # same point of its epochs, not from the parent's count (in the parent's steps: too far or not far enough)
    done = 0 if state is None else tr.warmup_steps + start_epoch * epoch_steps
    stepper = Stepper.build(spec, optimizer, net, ctx.device, tr.warmup_steps + tr.epochs * epoch_steps, done,
                            None if state is None else state.get("grad_scaler"))
    ctx.sink.emit({
        "kind": "start", "dataset": data.name, "task": data.task, "train_size": len(data.train),
        "test_size": len(data.test), "model": spec.model.kind, "params": param_count(model),
        "optimizer": spec.optimizer.name, "teleport": tp.method if tp.enabled else None,
        "device": str(ctx.device), "world_size": ctx.world_size, "resumed_from_epoch": start_epoch,
        "spec": spec.model_dump(mode="json"),
    })
    if start_epoch == 0 and (hint := schedule_hint(spec.optimizer.name, tp, tr.epochs)):
        ctx.sink.emit(hint)

    def train_steps(epoch_seed: int, limit: int | None) -> tuple[float, int, int]:
        """Primary optimizer steps over one shuffled pass (at most ``limit``), ``training.grad_accumulation`` batches
        each: (the batches' mean losses summed weighted by their samples, samples, steps)."""
        net.train()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        samples = steps = 0
        loader = ctx.loader(data.train, tr.batch_size, shuffle=True, seed=tr.seed, epoch=epoch_seed)
        for batch, share, steps_after in accumulated(loader, tr.grad_accumulation):
            if limit is not None and steps >= limit:
                break
            x, y = to_device(batch, ctx.device, dtype, non_blocking=True)  # on CUDA: no host sync a step
            with contextlib.nullcontext() if steps_after else no_sync():  # DDP all-reduces once a step
                with autocast(tr, ctx.device):  # training.precision bf16/fp16: forward and loss in it
                    loss = loss_fn(net(x), y)
                stepper.backward(loss * share if tr.grad_accumulation > 1 else loss)
            loss_sum += loss.detach() * y.shape[0]  # summed on the device: no host sync per step
            samples += y.shape[0]
            if steps_after:
                stepper.step()  # clipped, stepped, the lr moved along its schedule
                optimizer.zero_grad(set_to_none=True)
                steps += 1
        return float(loss_sum), samples, steps

    t0 = time.perf_counter() - seconds  # cumulative across a resume

    # -- warm-up: primary steps before the first teleport (paper: 40 for the CNNs); baselines get them too
    if start_epoch == 0 and tr.warmup_steps:
        done, total, counted, passes = 0, 0.0, 0, 0
        while done < tr.warmup_steps:
            loss_sum, samples, steps = train_steps(WARMUP_EPOCH + passes, tr.warmup_steps - done)
            if steps == 0:
                raise ValueError("training.warmup_steps: the training set gives no batches")
            total, done, counted, passes = total + loss_sum, done + steps, counted + samples, passes + 1
        loss_sum, samples = ctx.all_reduce_sum([total, float(counted)])
        if not _finite(loss_sum):
            raise diverged(ctx, "warm-up", 0, f"warm-up loss is {loss_sum / samples}",
                            f"lower optimizer.lr (now {spec.optimizer.lr:g})")
        ctx.sink.emit({"kind": "warmup", "steps": done, "train_loss": loss_sum / samples,
                       "seconds": time.perf_counter() - t0, **stepper.report()})

    def run_summary() -> dict[str, Any]:
        """Losses, time and targets, the budget's cuts, and the device (the GPUs it saw, its peak memory)."""
        return {**summarize(history, tr.target_loss, tele_batches), **teleporter.summary(), **device_report(ctx.device)}

    show = progress and ctx.is_chief  # a bar on a terminal (tqdm's disable=None); a log or a pipe gets plain lines
    bar = tqdm(range(start_epoch, tr.epochs), desc="epochs", unit="epoch", initial=start_epoch,
               total=tr.epochs, disable=None if show else True, dynamic_ncols=True)
    for epoch in bar:
        # -- teleport before the epoch: b batches of n random training samples, t ascent steps each
        if epoch in teleport_epochs and teleporter.skipped is None:  # a teleport that could not move: none after
            if not history:  # the budget projects the run's length from one timed training step
                teleporter.probe(net, loss_fn, data.train, tr.batch_size, epoch_batches)
            t_tele = time.perf_counter()
            try:
                ran = teleporter.run(epoch, model, loss_fn, teleporter.draw(data.train, tr.seed, epoch), tele_seconds,
                                     t_tele - t0 - tele_seconds, len(history), holdout)
            except TeleportDiverged as e:
                raise diverged(ctx, f"teleport batch {e.batch}", epoch, f"teleport batch loss is {e.loss}",
                                tp.calmer) from None
            tele_batches += len(ran)
            if tp.reset_optimizer and ran:  # the weights teleported: the optimizer's moments start afresh
                reset_optimizer_state(optimizer)
            tele_seconds += time.perf_counter() - t_tele

        # -- one epoch of the primary optimizer, then evaluation on the test set
        loss_sum, samples, _ = train_steps(epoch, tr.max_steps_per_epoch)  # the mean over samples, every rank's
        loss_sum, samples = ctx.all_reduce_sum([loss_sum, float(samples)])
        train_loss = loss_sum / max(samples, 1.0)
        test_loader = ctx.loader(data.test, tr.eval_batch_size, shuffle=False, seed=tr.seed, epoch=epoch)
        metrics = evaluate(model, test_loader, loss_fn, data.task, ctx, dtype)
        for name, value in [("train loss", train_loss), ("test loss", metrics["test_loss"])]:
            if not _finite(value):
                raise diverged(ctx, "training", epoch, f"{name} is {value}",
                                f"lower optimizer.lr (now {spec.optimizer.lr:g}) or {tp.step_field} / cap")
        record = {"kind": "epoch", "epoch": epoch, "train_loss": train_loss, **metrics, **stepper.report(),
                  "seconds": time.perf_counter() - t0, "teleport_seconds": tele_seconds,
                  **gpu_memory(ctx.device, ctx.all_reduce_sum, ctx.rank, ctx.world_size)}
        ctx.sink.emit(record)
        history.append(record)
        shown = {"train": "train_loss", "test": "test_loss", "acc": "test_acc", "lr": "lr"}
        bar.set_postfix({short: f"{record[key]:.4g}" for short, key in shown.items() if key in record})
        if show and bar.disable:
            print(f"epoch {epoch + 1}/{tr.epochs}  " + "  ".join(f"{short} {record[key]:.4g}" for short, key
                                                                in shown.items() if key in record),
                  file=sys.stderr, flush=True)

        # -- checkpoint (Ray: every rank reports, rank 0 attaches the state); no-op locally
        summary = run_summary()
        state = {"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "history": history, "seconds": record["seconds"], "teleport_seconds": tele_seconds,
                 "teleport_batches": tele_batches, "teleport_budget": teleporter.saved(),
                 **stepper.state()}
        ctx.save(state, summary)
    bar.close()

    summary = {**run_summary(), "params": param_count(model)}
    ctx.sink.emit({"kind": "summary", **summary})
    return summary


# ---------------------------------------------------------------------- local runs


def run_label(spec: ExperimentSpec) -> str:
    """How a run is named in plots: its teleport method, or 'no teleport'."""
    return f"{spec.teleport.method} teleport" if spec.teleport.enabled else "no teleport"


def run_local(spec: ExperimentSpec, out_dir: str | Path, *, progress: bool = True,
              sink: MetricSink | None = None, threads: int | None = None) -> dict[str, Any]:
    """Train in this process; write DIR/metrics.jsonl (line by line), DIR/summary.json, DIR/curves.png.

    ``sink`` also receives every record (the caller closes it). ``threads``: torch threads for
    the run (default ``resources.cpus_per_worker``, see ``num_threads``; 0 keeps torch's own).
    A diverged run still gets its curves (up to the failing epoch) and raises ``TrainingDiverged``.
    """
    from plots.curves import plot_curves

    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "summary.json", "curves.png"):  # a fresh run, not an append to an old one
        (out / name).unlink(missing_ok=True)
    memory, jsonl = MemorySink(), JsonlSink(out / "metrics.jsonl")
    sinks: list[MetricSink] = [jsonl, memory] + ([sink] if sink is not None else []) + ([SaySink()] if progress else [])
    ctx = RunContext(device=select_device(spec.training), sink=TeeSink(*sinks))
    try:
        summary = train(spec, ctx, progress=progress, threads=threads)
    except BaseException:
        if created and not memory.records:  # failed before it started (no data, bad model): leave no dir
            jsonl.close()
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        jsonl.close()
        if any(r.get("kind") == "epoch" for r in memory.records):
            plot_curves({run_label(spec): memory.records}, out / "curves.png",
                        title=f"{spec.dataset.name} · {spec.model.kind} · {spec.optimizer.name}")
    summary = {**summary, "out_dir": str(out), "spec": spec.model_dump(mode="json")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float) + "\n")
    return summary
