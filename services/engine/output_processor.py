"""The engine's output stage: detokenize each new token, check every stop condition in one place,
finish stopped requests through the scheduler, build the RequestOutputs (those of finished
embeddings requests, and the final ones of requests whose grammar failed to compile, too).

vLLM V1's output processor, with the token stops (EOS, stop_token_ids, length) moved here too:
the scheduler only appends sampled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.outputs import CompletionOutput, RequestOutput
from kvmesh.engine.request import Request, RequestStatus
from kvmesh.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvmesh.engine.scheduler import Scheduler

Stop = tuple[RequestStatus, "int | str | None"]   # the finish status and the request's stop_reason


@dataclass(slots=True)
class RequestGroup:
    """The samples of one user request (n > 1 shares the prompt's blocks)."""
    request_id: str
    prompt: str | None                          # prompt text for the outputs (None: ids only)
    samples: list[Request]                      # sample i at index i
    detokenizers: list[IncrementalDetokenizer]  # one per sample, same order
    emitted: list[int] = field(default_factory=list)   # token ids already reported, per sample
    # NOTE: one dict for all of the group's outputs, filled in as the times become known
    # (arrival, first scheduled, first token): no per-step dict per request
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(r.is_finished for r in self.samples)


def stop_by_token(
    token_id: int,
    num_output_tokens: int,          # including token_id
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    max_tokens: int,                 # the request's cap (max_tokens, bounded by the context)
) -> tuple[str, int | None] | None:
    """("stop", token_id) for EOS (unless ignore_eos) or a stop token id once min_tokens are out,
    else ("length", None) once max_tokens are out, else None. A stop token on the last allowed
    position reports "stop", as it is the more precise reason."""
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return ("stop", token_id)
        if token_id in params.stop_token_ids:
            return ("stop", token_id)
    if num_output_tokens >= max_tokens:
        return ("length", None)
    return None


def token_stop(req: Request, index: int = -1) -> Stop | None:
    """The stop that the request's output token `index` (default: the last) causes by itself
    (EOS, a stop id, length)."""
    out = req.output_token_ids
    index = index % len(out)
    stop = stop_by_token(out[index], index + 1, req.sampling_params, req.eos_token_ids,
                         req.max_tokens)
    if stop is None:
        return None
    reason, token = stop
    if reason == "length":
        return RequestStatus.FINISHED_LENGTH, None
    # NOTE: vLLM's convention: stop_reason names a stop token id, None for EOS.
    return RequestStatus.FINISHED_STOPPED, None if token in req.eos_token_ids else token


def check_stop(req: Request, detok: IncrementalDetokenizer | None) -> Stop | None:
    """Every stop condition of the request's newest token, the one place they are checked.

    NOTE: the stop string wins over a length / EOS finish in the same token; an EOS or stop
    token itself is not detokenized (unless include_stop_str_in_output), as in vLLM."""
    stop = token_stop(req)
    if detok is not None:
        found = detok.update([req.output_token_ids[-1]],
                             stop_terminated=stop is not None
                             and stop[0] == RequestStatus.FINISHED_STOPPED)
        if found is not None:
            return RequestStatus.FINISHED_STOPPED, found
    return stop


def check_stops(req: Request, detok: IncrementalDetokenizer | None, first: int) -> Stop | None:
    """check_stop for each of the output tokens from index `first` on, in order (speculative
    decoding appends several per step): the first token that stops the request ends its output,
    the tokens after it are dropped (Request.truncate_output)."""
    out = req.output_token_ids
    if first >= len(out) - 1:
        return check_stop(req, detok)
    for i in range(first, len(out)):
        stop = token_stop(req, i)
        if detok is not None:
            found = detok.update([out[i]], stop_terminated=stop is not None
                                 and stop[0] == RequestStatus.FINISHED_STOPPED)
            if found is not None:
                stop = RequestStatus.FINISHED_STOPPED, found
        if stop is not None:
            req.truncate_output(i + 1)
            return stop
    return None


class OutputProcessor:
    """Turns the requests that got a token this step into RequestOutputs."""

    def __init__(self, scheduler: Scheduler, groups: dict[str, RequestGroup]) -> None:
        self.scheduler = scheduler
        self.groups = groups       # the engine's live requests by id (add_request fills it)

    def process(self, touched: list[Request],
                pooled: dict[str, list[float]] | None = None) -> list[RequestOutput]:
        """The step's outputs: first the embeddings requests in `pooled` (request id -> vector;
        the scheduler finished them), then the groups of `touched`, the requests that got new
        tokens this step (one, or a run verified by speculative decoding), in step order."""
        outputs = self._pooled_outputs(pooled) if pooled else []
        group_ids: dict[str, None] = {}
        for req in touched:
            group = self.groups.get(req.parent_id)
            if group is None:
                stop = check_stop(req, None)
            else:
                # NOTE: what the group emitted so far is what the request had before this step
                stop = check_stops(req, group.detokenizers[req.sample_index],
                                   group.emitted[req.sample_index])
            if stop is not None:
                self.scheduler.finish_request(req, *stop)
            if group is not None:
                group_ids[group.request_id] = None
        for gid in group_ids:
            group = self.groups[gid]
            outputs.append(self._make_output(group))
            if group.finished:
                del self.groups[gid]
        return outputs

    def fail(self, request_id: str, stop_reason: str) -> RequestOutput | None:
        """Abort a live request that cannot go on (its grammar failed to compile): its samples
        finish through the scheduler with `stop_reason`; returns its final output (None: it had
        already ended)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.scheduler.abort_requests([r.request_id for r in group.samples])
        for req in group.samples:
            req.stop_reason = stop_reason
        return self._make_output(group)

    def _pooled_outputs(self, pooled: dict[str, list[float]]) -> list[RequestOutput]:
        outputs = []
        for rid, vector in pooled.items():
            group = self.groups.pop(rid, None)     # NOTE: pooled requests are n == 1
            if group is None:
                continue
            req = group.samples[0]
            metrics = {"arrival_time": req.arrival_time}
            if req.first_scheduled_time is not None:
                metrics["first_scheduled_time"] = req.first_scheduled_time
            outputs.append(RequestOutput(
                rid, group.prompt, req.prompt_token_ids,
                [CompletionOutput(0, "", [], None, req.finish_reason)], True,
                max(req.num_cached_tokens, 0), metrics, embedding=vector))
        return outputs

    @staticmethod
    def _make_output(group: RequestGroup) -> RequestOutput:
        """The group's delta since its previous output: O(new tokens), whatever the length so
        far; only the final output (the group finished) copies the cumulative result, once."""
        final = group.finished
        completions = []
        for i, (req, detok) in enumerate(zip(group.samples, group.detokenizers)):
            start, end = group.emitted[i], req.num_output_tokens
            group.emitted[i] = end
            want_logprobs = req.sampling_params.logprobs is not None
            completions.append(CompletionOutput(
                index=i,
                text=detok.output_text if final else "",
                token_ids=list(req.output_token_ids) if final else [],
                logprobs=(list(req.output_logprobs) if final else []) if want_logprobs else None,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                delta_text=detok.get_delta(req.is_finished),
                delta_token_ids=req.output_token_ids[start:end],
                delta_logprobs=req.output_logprobs[start:end] if want_logprobs else None,
            ))
        first = group.samples[0]
        metrics = group.metrics
        if len(metrics) < 3:
            metrics["arrival_time"] = first.arrival_time
            if first.first_scheduled_time is not None:
                metrics["first_scheduled_time"] = first.first_scheduled_time
            if first.first_token_time is not None:
                metrics["first_token_time"] = first.first_token_time
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, completions,
                             group.finished, max(first.num_cached_tokens, 0), metrics,
                             prompt_logprobs=first.prompt_logprobs,
                             kv_transfer_params=first.kv_transfer_result if final else None)
