"""A deterministic stand-in for `aserve.engine.async_engine.AsyncEngine` (same interface).

It "generates" word tokens of a real tokenizer: greedy requests (temperature 0) get a sequence that
depends only on the prompt; seeded requests one that depends only on the seed and sample index.
It honours max_tokens, stop strings, stop_token_ids, n / best_of, logprobs, prompt_logprobs and
the three output kinds, and reports stats to its StatLoggers each step. `expected_token_ids` gives
tests the reference output.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
from anyio.abc import TaskStatus

from aserve.config import ArchConfig, ModelConfig
from aserve.engine.input_processor import InputProcessor
from aserve.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from aserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams

_CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
    "hello world how are you today my friend the weather is nice and the sun is bright",
    "models generate tokens one after another until they reach a stop or the length limit",
    "servers stream events to clients over http and clients read every chunk as it comes",
    "alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega",
    "red green blue yellow orange purple black white silver golden",
    "one two three four five six seven eight nine ten eleven twelve",
    "system user assistant tool message content role answer question",
]


def build_tokenizer(
    special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    chat_template: str | None = None,
) -> Any:
    """A byte-level BPE tokenizer trained in milliseconds on a tiny corpus (lossless round trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(special_tokens),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special_tokens[0])
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


class EngineDeadError(RuntimeError):
    pass


def make_model_config(
    vocab_size: int, max_model_len: int, served_model_names: tuple[str, ...], max_logprobs: int = 20
) -> ModelConfig:
    arch = ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
        attention_bias=False,
        hidden_act="silu",
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_ids=(0,),
    )
    return ModelConfig(
        model="fake-model",
        model_path="/nonexistent/fake-model",
        tokenizer="fake",
        tokenizer_revision=None,
        trust_remote_code=False,
        dtype="float32",
        max_model_len=max_model_len,
        seed=0,
        served_model_names=served_model_names,
        max_logprobs=max_logprobs,
        generation_config="auto",
        arch=arch,
    )


class FakeRequestStream:
    def __init__(self, receive: Any, prompt_token_ids: list[int]):
        self._receive = receive
        self.prompt_token_ids = prompt_token_ids

    def __aiter__(self) -> FakeRequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            item = await self._receive.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Sample:
    index: int
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    send: Any
    samples: list[_Sample]
    arrival: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class FakeAsyncEngine:
    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int = 256,
        served_model_names: tuple[str, ...] = ("fake-model",),
        step_delay: float = 0.002,
        num_blocks: int = 512,
        block_size: int = 16,
        max_logprobs: int = 20,
    ):
        self.tokenizer = tokenizer
        self.model_config = make_model_config(len(tokenizer), max_model_len, served_model_names, max_logprobs)
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.word_ids = self._word_token_ids(tokenizer)
        self.requests: dict[str, _Request] = {}
        self.added: list[tuple[str, list[int], SamplingParams, int]] = []
        self.aborted: list[str] = []
        self.stat_loggers: list[Any] = []
        self.errored = False
        self.dead_error: BaseException | None = None
        self.paused = False  # tests: hold generation (requests stay in flight)
        # tests may set `errored = True` alone to make health checks fail without stopping the loop
        self._stopped = False
        self._running = False
        self._stats = SchedulerStats(num_total_blocks=num_blocks)
        self._seen_prefixes: set[tuple[int, ...]] = set()

    # -- reference behaviour -----------------------------------------------------------------------
    @staticmethod
    def _word_token_ids(tokenizer: Any) -> list[int]:
        words = []
        for token_id in sorted(tokenizer.get_vocab().values()):
            text = tokenizer.decode([token_id])
            if re.fullmatch(r" [a-z]{2,}", text):
                words.append(token_id)
        assert len(words) >= 20, "the test tokenizer needs more whole-word tokens"
        return words

    def _rng(self, prompt_token_ids: list[int], params: SamplingParams, index: int) -> random.Random:
        if params.seed is not None:
            return random.Random(f"seed:{params.seed}:{index}")
        if params.temperature == 0:
            return random.Random(f"greedy:{','.join(map(str, prompt_token_ids))}")
        return random.Random()

    def expected_token_ids(
        self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0, length: int | None = None
    ) -> list[int]:
        """The first `length` (default max_tokens) tokens sample `index` draws, before stop handling."""
        rng = self._rng(prompt_token_ids, params, index)
        return [rng.choice(self.word_ids) for _ in range(length or params.max_tokens or 16)]

    # -- AsyncEngine interface ---------------------------------------------------------------------
    def add_stat_logger(self, logger: Any) -> None:
        self.stat_loggers.append(logger)

    def is_healthy(self) -> bool:
        return not self.errored

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"engine died: {self.dead_error!r}")

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> FakeRequestStream:
        if self.errored:
            raise EngineDeadError("engine is dead")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        # The real engine's intake checks (InputProcessor only reads these config fields).
        config = SimpleNamespace(model=self.model_config, parallel=SimpleNamespace(distributed_executor_backend="uni"),
                                 structured_outputs=SimpleNamespace(backend="auto"))
        intake = InputProcessor(config, self.tokenizer, (0,))  # type: ignore[arg-type]
        prompt_token_ids = intake.process_prompt(prompt, prompt_token_ids, params)
        send, receive = anyio.create_memory_object_stream(math.inf)
        samples = [_Sample(i, self._rng(prompt_token_ids, params, i)) for i in range(params.num_samples)]
        self.requests[request_id] = _Request(
            request_id, prompt, list(prompt_token_ids), params, send, samples, time.time()
        )
        self.added.append((request_id, list(prompt_token_ids), params, priority))
        return FakeRequestStream(receive, list(prompt_token_ids))

    async def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.aborted.append(request_id)
        req.send.close()
        finished = self._finished_stats(req, "abort")
        self._publish(IterationStats(finished_requests=[finished]))

    def shutdown(self) -> None:
        self._stopped = True

    def kill(self, error: BaseException) -> None:
        """Simulate the engine loop dying: streams raise, run() raises, health fails."""
        self.errored = True
        self.dead_error = error
        for req in self.requests.values():
            req.send.send_nowait(EngineDeadError(f"engine died: {error!r}"))
            req.send.close()
        self.requests.clear()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._running = True
        task_status.started()
        try:
            while not self._stopped:
                if self.dead_error is not None:
                    raise EngineDeadError(f"engine died: {self.dead_error!r}")
                await anyio.sleep(self.step_delay if self.requests else 0.005)
                if self.requests and not self.paused:
                    self._step()
        finally:
            self._running = False
            for req in self.requests.values():
                req.send.close()
            self.requests.clear()

    # -- one step ----------------------------------------------------------------------------------
    def _logprob_entry(self, token_id: int, position: int, k: int) -> dict[int, Logprob]:
        entry = {
            token_id: Logprob(
                -0.25 - 0.01 * position, rank=1, decoded_token=self.tokenizer.decode([token_id])
            )
        }
        alternatives = [t for t in self.word_ids if t != token_id]
        for r in range(k):
            alt = alternatives[(position + r) % len(alternatives)]
            entry[alt] = Logprob(-1.5 - r, rank=r + 2, decoded_token=self.tokenizer.decode([alt]))
        return entry

    def _advance(self, req: _Request, s: _Sample) -> None:
        p = req.params
        token = s.rng.choice(self.word_ids)
        s.token_ids.append(token)
        if p.logprobs is not None:
            entry = self._logprob_entry(token, len(s.token_ids) - 1, p.logprobs)
            s.logprobs.append(entry)
            s.cumulative_logprob += entry[token].logprob
        else:
            s.cumulative_logprob += -0.25 - 0.01 * (len(s.token_ids) - 1)
        if p.stop_token_ids and token in p.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
            return
        s.text = self.tokenizer.decode(s.token_ids)
        for stop in p.stop or ():
            idx = s.text.find(stop)
            if idx >= 0:
                s.text = s.text[: idx + (len(stop) if p.include_stop_str_in_output else 0)]
                s.finish_reason, s.stop_reason = "stop", stop
                return
        if p.max_tokens is not None and len(s.token_ids) >= p.max_tokens:
            s.finish_reason = "length"

    def _step(self) -> None:
        now = time.time()
        it = IterationStats()
        done: list[str] = []
        for req in list(self.requests.values()):
            first = req.first_token_time is None
            if first:
                it.num_prompt_tokens += len(req.prompt_token_ids)
                self._count_prefix(req.prompt_token_ids)
            changed = []
            for s in req.samples:
                if s.finish_reason is None:
                    self._advance(req, s)
                    it.num_generation_tokens += 1
                    changed.append(s)
            if first:
                req.first_token_time = now
                it.time_to_first_tokens.append(now - req.arrival)
            else:
                it.inter_token_latencies.append(now - (req.last_token_time or now))
            req.last_token_time = now
            out = self._output(req, changed)
            if out is not None:
                req.send.send_nowait(out)
            if req.finished:
                req.send.close()
                done.append(req.request_id)
                reason = req.samples[0].finish_reason or "stop"
                it.finished_requests.append(self._finished_stats(req, reason))
        for rid in done:
            self.requests.pop(rid, None)
        self._publish(it)

    def _count_prefix(self, prompt: list[int]) -> None:
        full = len(prompt) // self.block_size
        hits = 0
        for b in range(1, full + 1):
            key = tuple(prompt[: b * self.block_size])
            if key in self._seen_prefixes:
                hits = b * self.block_size
            self._seen_prefixes.add(key)
        self._stats.prefix_cache_queries += len(prompt)
        self._stats.prefix_cache_hits += hits

    def _completion(self, s: _Sample, delta: bool) -> CompletionOutput:
        if delta:
            out = CompletionOutput(
                index=s.index,
                text=s.text[s.sent_text :],
                token_ids=s.token_ids[s.sent_tokens :],
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs[s.sent_tokens :] if s.logprobs else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            s.sent_text, s.sent_tokens = len(s.text), len(s.token_ids)
            return out
        return CompletionOutput(
            index=s.index,
            text=s.text,
            token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob,
            logprobs=list(s.logprobs) or None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    def _prompt_logprobs(self, req: _Request) -> list[dict[int, Logprob] | None] | None:
        k = req.params.prompt_logprobs
        if k is None:
            return None
        return [None] + [self._logprob_entry(t, i, k) for i, t in enumerate(req.prompt_token_ids[1:])]

    def _output(self, req: _Request, changed: list[_Sample]) -> RequestOutput | None:
        kind = req.params.output_kind
        finished = req.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            outputs = [self._completion(s, delta=True) for s in changed]
        else:
            samples = req.samples
            if finished and len(samples) > req.params.n:  # best_of: the n most likely, renumbered
                best = sorted(samples, key=lambda s: -s.cumulative_logprob)[: req.params.n]
                outputs = []
                for i, s in enumerate(sorted(best, key=lambda s: s.index)):
                    c = self._completion(s, delta=False)
                    c.index = i
                    outputs.append(c)
            else:
                outputs = [self._completion(s, delta=False) for s in samples]
        prompt_logprobs = None
        if not req.prompt_sent:
            prompt_logprobs = self._prompt_logprobs(req)
            req.prompt_sent = True
        metrics = RequestMetrics(
            arrival_time=req.arrival,
            first_token_time=req.first_token_time,
            last_token_time=req.last_token_time,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=metrics,
        )

    def _finished_stats(self, req: _Request, reason: str) -> FinishedRequestStats:
        now = time.time()
        generated = sum(len(s.token_ids) for s in req.samples)
        first = req.first_token_time or now
        decode = now - first
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - req.arrival,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=generated,
            max_tokens_param=req.params.max_tokens,
            n=req.params.n,
            queue_time=0.0,
            prefill_time=first - req.arrival,
            decode_time=decode,
            inference_time=now - req.arrival,
            mean_time_per_output_token=decode / max(generated - 1, 1),
        )

    def _publish(self, it: IterationStats) -> None:
        used = 0
        tokens = 0
        for req in self.requests.values():
            length = len(req.prompt_token_ids) + max((len(s.token_ids) for s in req.samples), default=0)
            used += -(-length // self.block_size)
            tokens += length
        s = self._stats
        s.num_running_reqs = len(self.requests)
        s.num_waiting_reqs = 0
        s.num_used_blocks = used
        s.num_tokens_in_used_blocks = tokens
        s.kv_cache_usage = used / self.num_blocks
        self._stats = SchedulerStats(**vars(s))
        for logger in self.stat_loggers:
            logger.record(self._stats, it)
