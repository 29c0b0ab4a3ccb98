"""The one per-step loop over engine outputs: detokenize, stop strings, logprobs, RequestOutputs, stats.

A user request with n (or best_of) samples is one `RequestState` holding one `SampleState` per
sample; each sample is its own scheduler request (`child_request_id`). Stop strings are found here
(they need text); the matching samples are returned in `reqs_to_finish` so the engine tells the
scheduler, which frees their blocks before the next step.

A failure that belongs to one request (the runner reported it, or detokenizing its tokens raised)
fails that whole request (every sample ends with finish_reason "error", `RequestOutput.error` says
why) and nothing else; its samples still scheduled are returned in `reqs_to_abort`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from aserve.core.batch import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, TokenLogprobs
from aserve.engine.detokenizer import IncrementalDetokenizer, check_stop_strings, decode_token_texts
from aserve.engine.stats import FinishedRequestStats, IterationStats, RequestTrace
from aserve.lora.request import LoRARequest
from aserve.outputs import CompletionOutput, Logprob, RequestError, RequestMetrics, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def record_events(m: RequestMetrics, events: list[EngineCoreEvent]) -> None:
    """Scheduling events into a request's metrics: its first scheduling (queue time) and preemptions."""
    for event in events:
        if event.type == EngineCoreEventType.SCHEDULED and m.first_scheduled_time is None:
            m.first_scheduled_time = event.timestamp
            m.time_in_queue = max(event.timestamp - m.arrival_time, 0.0)
        elif event.type == EngineCoreEventType.PREEMPTED:
            m.num_preemptions += 1


def child_request_id(request_id: str, index: int, num_samples: int) -> str:
    return request_id if num_samples == 1 else f"{request_id}#{index}"


@dataclass
class SampleState:
    index: int
    req_id: str
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    changed: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    user_wants_logprobs: bool
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    stop_hold_back: int = 0
    last_token_time: float | None = None
    num_finished: int = 0
    error: RequestError | None = None
    lora_request: LoRARequest | None = None
    trace_headers: dict[str, str] | None = None
    model_forward_time: float = 0.0  # seconds, summed over the steps it was scheduled in (detailed traces)
    model_execute_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_finish: list[str]  # sample request ids that matched a stop string
    reqs_to_abort: list[str]  # sample request ids of requests that failed, still known to the scheduler
    iteration_stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.sample_owner: dict[str, tuple[RequestState, SampleState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, user_wants_logprobs: bool, arrival_time: float,
                    lora_request: LoRARequest | None = None,
                    trace_headers: dict[str, str] | None = None) -> list[str]:
        """Registers a request; returns the sample request ids the engine must schedule.
        `trace_headers` (W3C `traceparent` / `tracestate`) go into its finished stats' `trace`."""
        num = params.num_samples
        samples = []
        for i in range(num):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            samples.append(SampleState(
                index=i, req_id=child_request_id(request_id, i, num), detokenizer=detok,
                logprobs=[] if params.logprobs is not None and user_wants_logprobs else None,
                # best_of ranks samples by cumulative logprob, so it is tracked for it too.
                cumulative_logprob=0.0 if params.logprobs is not None or params.num_samples > params.n else None))
        state = RequestState(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
            user_wants_logprobs=user_wants_logprobs, samples=samples,
            metrics=RequestMetrics(arrival_time=arrival_time),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            stop_hold_back=max((len(s) for s in params.stop or ()), default=1) - 1
            if not params.include_stop_str_in_output else 0,
            lora_request=lora_request,
            trace_headers=trace_headers or None,
        )
        self.requests[request_id] = state
        for s in samples:
            self.sample_owner[s.req_id] = (state, s)
        return [s.req_id for s in samples]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def sample_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [s.req_id for s in state.samples] if state else []

    def abort_request(self, request_id: str, stats: IterationStats | None = None) -> RequestOutput | None:
        """Drops a request (client gone or aborted); returns its final output with finish_reason 'abort'. Its
        finished-request record goes into `stats` (metrics, traces), as a request finishing in a step does."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for s in state.samples:
            self.sample_owner.pop(s.req_id, None)
            if s.finish_reason is None:
                s.finish_reason = "abort"
                s.changed = True
        state.num_finished = len(state.samples)
        if stats is not None:
            now = time.time()
            state.metrics.finished_time = now
            stats.finished_requests.append(self._finished_stats(state, now))
        return self._make_output(state)

    def add_model_times(self, req_ids: list[str], forward_time: float, execute_time: float) -> None:
        """Adds one step's model times to each request that had a sample in it (`req_ids`: sample ids);
        a request whose several samples shared the step counts the step once."""
        seen: set[str] = set()
        for req_id in req_ids:
            owner = self.sample_owner.get(req_id)
            if owner is None or owner[0].request_id in seen:
                continue
            seen.add(owner[0].request_id)
            owner[0].model_forward_time += forward_time
            owner[0].model_execute_time += execute_time

    # -- the per-step loop ------------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> ProcessedOutputs:
        now = time.time() if now is None else now
        stats = IterationStats()
        touched: dict[str, RequestState] = {}
        to_finish: list[str] = []
        to_abort: list[str] = []
        for out in outputs:
            owner = self.sample_owner.get(out.req_id)
            if owner is None:
                continue  # aborted meanwhile
            state, sample = owner
            if sample.finish_reason is not None:
                continue  # stopped by a stop string last step; this token was computed speculatively
            if out.events:
                self._record_events(state, out)
            if out.finish_reason == "error":
                self._fail(state, RequestError(out.error or "the request failed", bad_input=True), to_abort)
            else:
                try:
                    if self._process_one(state, sample, out, stats, now):
                        to_finish.append(sample.req_id)
                except Exception as exc:  # e.g. the tokenizer cannot decode its tokens: this request only
                    logger.exception("processing the output of request %s failed", state.request_id)
                    self._fail(state, RequestError(f"processing the output failed: {exc!r}", bad_input=False),
                               to_abort)
            if sample.changed:
                touched[state.request_id] = state

        request_outputs = []
        for state in touched.values():
            out = self._make_output(state)
            if out is not None:
                request_outputs.append(out)
            if state.finished:
                self.requests.pop(state.request_id, None)
                state.metrics.finished_time = now
                stats.finished_requests.append(self._finished_stats(state, now))
        return ProcessedOutputs(request_outputs, to_finish, to_abort, stats)

    # -- pieces -----------------------------------------------------------------------------------
    def _process_one(self, state: RequestState, sample: SampleState, out: EngineCoreOutput,
                     stats: IterationStats, now: float) -> bool:
        """Applies one output to its sample; True when the sample's text hit a stop string."""
        if out.new_prompt_logprobs and state.prompt_logprobs is not None and sample.index == 0:
            state.prompt_logprobs.extend(self._logprob_dicts(out.new_prompt_logprobs))
        hit_stop = False
        if out.new_token_ids:
            self._record_token_timing(state, stats, now, len(out.new_token_ids), out.num_cached_tokens)
            if state.params.stop and sample.detokenizer is not None:
                # Token by token (speculation brings several a step): nothing after a stop string is kept.
                lps = out.new_logprobs
                for i, token in enumerate(out.new_token_ids):
                    self._append_tokens(sample, [token], lps[i:i + 1] if lps else [])
                    hit_stop = self._check_stop_strings(state, sample)
                    if hit_stop:
                        break
            else:
                self._append_tokens(sample, out.new_token_ids, out.new_logprobs)
        if sample.finish_reason is None and out.finish_reason is not None:
            sample.finish_reason = out.finish_reason
            sample.stop_reason = out.stop_reason
        if sample.finish_reason is not None:
            self._finish_sample(state, sample)
        elif out.new_token_ids:
            sample.changed = True
        return hit_stop

    def _finish_sample(self, state: RequestState, sample: SampleState) -> None:
        state.num_finished += 1
        sample.changed = True
        self.sample_owner.pop(sample.req_id, None)

    def _fail(self, state: RequestState, error: RequestError, to_abort: list[str]) -> None:
        """Ends every unfinished sample of the request with "error"; they go to `to_abort`."""
        state.error = error
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = "error"
                self._finish_sample(state, s)
                to_abort.append(s.req_id)

    @staticmethod
    def _record_events(state: RequestState, out: EngineCoreOutput) -> None:
        record_events(state.metrics, out.events)

    def _record_token_timing(self, state: RequestState, stats: IterationStats, now: float, num_new: int,
                             num_cached: int) -> None:
        m = state.metrics
        stats.num_generation_tokens += num_new
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = num_cached
            state.num_cached_tokens = num_cached
            stats.time_to_first_tokens.append(now - m.arrival_time)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif state.last_token_time is not None:
            stats.inter_token_latencies.append(now - state.last_token_time)
        state.last_token_time = now
        m.last_token_time = now

    def _logprob_dicts(self, entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        texts = decode_token_texts(self.tokenizer, [t for e in entries for t in e.token_ids]) \
            if self.tokenizer is not None else None
        result, k = [], 0
        for e in entries:
            d: dict[int, Logprob] = {}
            for tok, lp, rank in zip(e.token_ids, e.logprobs, e.ranks):
                if tok not in d:
                    d[tok] = Logprob(logprob=lp, rank=rank, decoded_token=texts[k] if texts else None)
                k += 1
            result.append(d)
        return result

    def _append_tokens(self, sample: SampleState, token_ids: list[int], logprobs: list[TokenLogprobs]) -> None:
        sample.token_ids.extend(token_ids)
        if logprobs:
            if sample.cumulative_logprob is not None:
                sample.cumulative_logprob += sum(e.logprobs[0] for e in logprobs)
            if sample.logprobs is not None:
                sample.logprobs.extend(self._logprob_dicts(logprobs))
        if sample.detokenizer is not None:
            sample.detokenizer.update(token_ids)
            sample.text = sample.detokenizer.output_text

    def _check_stop_strings(self, state: RequestState, sample: SampleState) -> bool:
        params = state.params
        if len(sample.token_ids) < params.min_tokens:
            return False
        new_chars = len(sample.text) - sample.num_sent_chars
        hit = check_stop_strings(sample.text, max(new_chars, 0) + state.stop_hold_back, params.stop,
                                 params.include_stop_str_in_output)
        if hit is None:
            return False
        stop_str, cut = hit
        sample.text = sample.text[:cut]
        sample.finish_reason, sample.stop_reason = "stop", stop_str
        return True

    def _completion(self, state: RequestState, s: SampleState, delta: bool) -> CompletionOutput:
        finished = s.finish_reason is not None
        text_end = len(s.text) if finished else max(len(s.text) - state.stop_hold_back, s.num_sent_chars) \
            if state.params.stop else len(s.text)
        if delta:
            text = s.text[s.num_sent_chars:text_end]
            token_ids = s.token_ids[s.num_sent_tokens:]
            logprobs = s.logprobs[s.num_sent_tokens:] if s.logprobs is not None else None
        else:
            text, token_ids = s.text[:text_end], list(s.token_ids)
            logprobs = list(s.logprobs) if s.logprobs is not None else None
        s.num_sent_chars, s.num_sent_tokens = text_end, len(s.token_ids)
        return CompletionOutput(index=s.index, text=text, token_ids=token_ids,
                                cumulative_logprob=s.cumulative_logprob if state.user_wants_logprobs else None,
                                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        params = state.params
        kind = params.output_kind
        finished = state.finished
        if params.num_samples > params.n:
            # best_of: only the n best (by cumulative logprob) are returned, once, at the end.
            if not finished:
                return None
            ranked = sorted(state.samples, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)[: params.n]
            completions = []
            for i, s in enumerate(ranked):
                c = self._completion(state, s, delta=False)
                c.index = i
                completions.append(c)
        elif kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        elif kind == RequestOutputKind.DELTA:
            completions = [self._completion(state, s, delta=True) for s in state.samples if s.changed]
        else:
            completions = [self._completion(state, s, delta=False) for s in state.samples]
        for s in state.samples:
            s.changed = False
        prompt_logprobs = state.prompt_logprobs
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions, finished=finished, metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens, error=state.error, lora_request=state.lora_request)

    def _finished_stats(self, state: RequestState, now: float) -> FinishedRequestStats:
        m = state.metrics
        first = m.first_token_time or now
        scheduled = m.first_scheduled_time or m.arrival_time
        num_gen = sum(len(s.token_ids) for s in state.samples)
        decode_time = max(now - first, 0.0)
        reasons = [s.finish_reason for s in state.samples]
        return FinishedRequestStats(
            finish_reason=reasons[0] or "abort",
            e2e_latency=now - m.arrival_time,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=num_gen,
            max_tokens_param=state.params.max_tokens,
            n=state.params.n,
            queue_time=max(scheduled - m.arrival_time, 0.0),
            prefill_time=max(first - scheduled, 0.0),
            decode_time=decode_time,
            inference_time=max(now - scheduled, 0.0),
            mean_time_per_output_token=decode_time / (num_gen - 1) if num_gen > 1 else 0.0,
            lora_name=state.lora_request.lora_name if state.lora_request is not None else None,
            max_num_generation_tokens=max(len(s.token_ids) for s in state.samples),
            trace=RequestTrace(
                request_id=state.request_id, arrival_time=m.arrival_time, finished_time=now,
                time_to_first_token=m.first_token_time - m.arrival_time if m.first_token_time is not None else None,
                temperature=state.params.temperature, top_p=state.params.top_p, trace_headers=state.trace_headers,
                model_forward_time=state.model_forward_time, model_execute_time=state.model_execute_time),
        )
