"""A preflight's check itself (``python -m workers.preflight`` starts it in the job's sandbox, as a payload of
kind ``preflight``): the user's factories imported, model and data built, one forward and backward on a small
batch and one teleport step; the verdict (``api_schemas.preflight.PreflightResult``) written where the scheduler
reads it. Torch and the user's code are imported only inside the functions: the entry point stays light."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from api_schemas import ExperimentSpec, keys
from api_schemas.preflight import PreflightResult
from api_schemas.sweeps import preflighted_spec
from workers.job.orders import Orders
from workers.train.sinks import MetricSink

if TYPE_CHECKING:
    from api_schemas.spec import TeleportSpec
    from teleport import TeleportReport

SMALL_BATCH = 8  # samples in the forward/backward pass


def _user_line(err: BaseException) -> str:
    """The one line of an error: the user's file:line when it passed through their code."""
    from workers.train.failure import failure_reason
    from workers.train.user_code import UserCodeError

    return str(err) if isinstance(err, UserCodeError) else failure_reason(err)


def _step(spec: ExperimentSpec, sink: MetricSink, out: dict[str, Any]) -> None:
    """Build model and data, one forward and backward, one teleport step; what it measured goes into ``out``."""
    import torch

    from workers.train.build import build_parts, seed_everything, select_dtype, teleport_config
    from workers.train.shared import param_count
    from workers.train.teleporting import sample_batch, to_device

    seed_everything(spec.training.seed)
    data, model, loss_fn = build_parts(spec, sink, spec.training.seed)
    dtype, cpu = select_dtype(spec.training), torch.device("cpu")
    model = model.to(dtype=dtype)
    out.update(params=param_count(model), task=data.task, train_size=len(data.train), test_size=len(data.test),
               sample_shape=list(data.input_shape))
    n = min(SMALL_BATCH, spec.training.batch_size, len(data.train))
    x, y = to_device(sample_batch(data.train, torch.arange(n)), cpu, dtype)
    loss = loss_fn(model(x), y)
    loss.backward()
    out["loss"] = float(loss.detach())
    tp = spec.teleport
    if not tp.enabled:
        return
    # one step, and no CAP: the bases are built (and the free directions counted) whatever the batch's gradient
    config = dataclasses.replace(teleport_config(tp), steps=1, cap=float("inf"))
    idx = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(spec.training.seed))
    x, y = to_device(sample_batch(data.train, idx[: tp.batch_size]), cpu, dtype)
    model.zero_grad(set_to_none=True)
    if tp.method == "symmetry":
        from teleport import symmetry_teleport_batch

        report = symmetry_teleport_batch(model, loss_fn, x, y, config)
    else:
        from teleport import teleport_batch

        report = teleport_batch(model, loss_fn, x, y, config)
    out.update(teleport=tp.method, tau=tp.tau, free_directions=report.free_directions,
               layers=[dataclasses.asdict(layer) for layer in report.layers], untouched=dict(report.untouched),
               grad_norm_sq=report.grad_norm_sq_before, grad_norm_sq_after_step=report.grad_norm_sq_after,
               step_advice=step_advice(report, tp))


def step_advice(report: TeleportReport, tp: TeleportSpec) -> str:
    """One line on the preflight's teleport step (``report``, taken with no CAP) against the spec's ``teleport``:
    a ‖∇L‖² already over ``cap`` (teleport would take no step), a rise that ``teleport.steps`` such steps keep under
    ``SMALL_RISE`` (the step too small to matter, as the paper's η 0.2 is for an LM), else the rise itself."""
    from workers.train.teleport_hints import SMALL_RISE, larger_steps

    before, after = report.grad_norm_sq_before, report.grad_norm_sq_after
    seen = f"‖∇L‖² {before:.3g} at the model's first weights"
    if tp.cap is not None and before >= tp.cap:
        return f"{seen}, over teleport.cap={tp.cap:g}: no step would be taken; raise the cap above {before:.3g}"
    if report.stop_reason == "no_free_directions":
        return f"{seen}; no layer has a free direction: lower teleport.batch_size (now {tp.batch_size})"
    step = f"one step at {tp.step_field}={tp.step_value:g}"
    if not report.steps:
        return f"{seen}; {step} was refused ({report.stop_reason}): lower {tp.step_field}"
    rise = f"{step} took it to {after:.3g} ({after / before - 1:+.1%})"
    if report.backoffs:  # a larger step would move the batch loss more: the limit is loss_tol, not the step's size
        return (f"{seen}; {rise} once halved {report.backoffs} times: a longer step moved the batch loss by over "
                f"teleport.loss_tol={tp.loss_tol:g}")
    if (after / before) ** tp.steps < SMALL_RISE:  # at that rate, a batch's teleport.steps
        return (f"{seen}; {rise}: at that rate {tp.steps} steps raise it by under {SMALL_RISE - 1:.0%}, too little to "
                f"matter; {larger_steps(tp)}")
    return f"{seen}; {rise}"


def preflight(spec: ExperimentSpec, sink: MetricSink) -> PreflightResult:
    """The verdict on ``spec`` in this process (one CPU, no Ray, no Redis: ``sink`` gets a traceback's log event)."""
    from workers.train.user_code import UserCodeError, report

    started = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        if spec.training.entrypoint:
            from workers.train.own_loop import entrypoint

            entrypoint(spec)  # imported and taking one argument: the loop itself needs the gang
            out["entrypoint"] = spec.training.entrypoint
        else:
            _step(spec, sink, out)
    except Exception as err:
        traceback.print_exc()  # the whole story, for the job's log
        line = _user_line(err)
        if not isinstance(err, UserCodeError):  # build_parts already sent a UserCodeError's traceback
            report(sink, UserCodeError(line, "".join(traceback.format_exception(err))))
        return PreflightResult(state="failed", error=line, seconds=time.perf_counter() - started, **out)
    return PreflightResult(state="passed", seconds=time.perf_counter() - started, **out)


def run_preflight(orders: Orders) -> PreflightResult:
    """In the payload: try the spec its supervisor read from the job's record (a sweep's first point); the verdict
    goes back in its outcome, and the supervisor writes it where the scheduler reads it (``record_verdict``)."""
    import torch

    from workers.job.logs import capture
    from workers.job.pipe_sink import records_sink

    torch.set_num_threads(1)
    with capture(orders.storage, orders.job_id, "preflight", 1):
        spec, sweep = ExperimentSpec.model_validate_json(orders.spec), orders.sweep
        sink = records_sink(orders)
        try:
            spec = preflighted_spec(spec, json.loads(sweep) if sweep else None)
            verdict = preflight(spec, sink)
        except ValueError as err:  # a sweep's first point that does not validate
            verdict = PreflightResult(state="failed", error=_user_line(err))
        finally:
            sink.close()
        print(f"preflight {verdict.state}: {verdict.error or verdict.model_dump_json(exclude_none=True)}",
              file=sys.stderr, flush=True)
    return verdict


def record_verdict(redis_url: str, job_id: str, said: object) -> PreflightResult:
    """The supervisor's side: the payload's verdict, checked as a ``PreflightResult``, written where the scheduler
    reads it (through the bounded script)."""
    from workers.job.record import connect, write_hash

    verdict = PreflightResult.model_validate(said)
    client = connect(redis_url, decode_responses=True)
    try:
        write_hash(client, job_id, keys.preflight(job_id), {"result": verdict.model_dump_json()})
    finally:
        client.close()
    return verdict
