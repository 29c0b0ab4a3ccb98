"""A fake model under the real engine: everything above the runner (AsyncEngine / LLMEngine, the
scheduler, the output processor, the server) is the production code; only the forward pass is fake.

* `build_model_folder(path)` writes a model folder the engine accepts: a config.json (tiny Llama
  shape, `vocab_size` = the tokenizer's size) and a small real byte-level BPE tokenizer, no weights
  (the fake runner never loads any).
* `FakeModel` is the "weights" and the test's remote control, shared by every runner made from it:
  it decides the tokens (greedy: a function of the sequence so far; seeded: of the seed and the
  position; otherwise random), always whole-word tokens (never EOS or a special token), so text is
  predictable; `expected_token_ids` gives tests the reference. `script` (token ids, EOS allowed) makes
  every request emit that text first, as a model that says "<think>a</think>b" would. It also holds
  the knobs: a per-step delay, pause / resume, failing chosen requests alone
  (`RunnerOutput.failed_requests`) and a fatal error raised from `execute`.
* `FakeRunner` follows the SchedulerOutput protocol of `aserve/core/batch.py`, as `ModelRunner` does.
* `fake_executor_factory(model)` plugs it in through the public factory:
  `AsyncEngine.from_engine_args(engine_args(folder), executor_factory=fake_executor_factory(model))`.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from aserve.config import AserveConfig, EngineArgs
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput, TokenLogprobs
from aserve.executor.thread import ThreadExecutor
from aserve.sampling_params import SamplingParams

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

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


def build_tokenizer(special_tokens: tuple[str, ...] = CHATML_SPECIALS, chat_template: str | None = None) -> Any:
    """A byte-level BPE tokenizer trained in milliseconds on a tiny corpus (lossless round trips); the
    first special token is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special_tokens[0])
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def build_model_folder(path: str | Path, special_tokens: tuple[str, ...] = CHATML_SPECIALS,
                       chat_template: str | None = None, max_position_embeddings: int = 1024) -> str:
    """Writes config.json and the tokenizer into `path` (no weights); returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(special_tokens, chat_template)
    tokenizer.save_pretrained(str(path))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(tokenizer),
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": max_position_embeddings,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "float32",
              "eos_token_id": tokenizer.eos_token_id}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def engine_args(folder: str, **overrides: Any) -> EngineArgs:
    """EngineArgs for a fake-model folder (CPU, fp32: nothing probes the hardware)."""
    base = {"model": folder, "dtype": "float32", "device": "cpu", "max_model_len": 256}
    return EngineArgs.from_kwargs(**{**base, **overrides})


def word_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's whole-word tokens (" word"): what the fake model generates."""
    words = [i for i in sorted(tokenizer.get_vocab().values()) if re.fullmatch(r" [a-z]{2,}", tokenizer.decode([i]))]
    assert len(words) >= 20, "the test tokenizer needs more whole-word tokens"
    return words


def _stable_hash(key: str) -> int:
    return zlib.crc32(key.encode())


class FakeModel:
    """The fake weights and the knobs a test turns while the engine runs (thread-safe enough: the
    runner reads them once per step)."""

    def __init__(self, word_ids: list[int], step_delay: float = 0.0, num_blocks: int = 512):
        self.word_ids = list(word_ids)
        self.step_delay = step_delay
        self.num_blocks = num_blocks
        # req_id, prompt token ids -> a message to fail that request alone (None: it runs)
        self.fail_if: Callable[[str, list[int]], str | None] | None = None
        self.fatal: BaseException | None = None  # raised by `execute` while set
        self.script: list[int] | None = None  # while set, every request's outputs start with these ids
        self._running = threading.Event()
        self._running.set()
        self.num_steps = 0

    @classmethod
    def for_folder(cls, folder: str, **kwargs: Any) -> FakeModel:
        from transformers import AutoTokenizer

        return cls(word_token_ids(AutoTokenizer.from_pretrained(folder)), **kwargs)

    # -- knobs ------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold the next step inside `execute` (requests stay in flight) until `resume()`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def wait_if_paused(self) -> None:
        assert self._running.wait(timeout=120), "the fake model stayed paused for two minutes"

    # -- the "weights" ----------------------------------------------------------------------------
    def next_token(self, tokens: list[int], num_prompt: int, params: SamplingParams) -> int:
        script, position = self.script, len(tokens) - num_prompt
        if script is not None and position < len(script):
            return script[position]
        if params.seed is not None:
            key = f"seed:{params.seed}:{len(tokens) - num_prompt}"
        elif params.sampling_type_greedy:
            key = "greedy:" + ",".join(map(str, tokens))
        else:
            return random.choice(self.word_ids)
        return self.word_ids[_stable_hash(key) % len(self.word_ids)]

    def logprobs(self, tokens: list[int], chosen: int, k: int) -> TokenLogprobs:
        """The chosen token first (rank 1, the most likely), then the top k: itself and k-1 others."""
        top = -0.1 - (_stable_hash(f"lp:{len(tokens)}:{chosen}") % 1000) / 1000
        others = [t for t in self.word_ids if t != chosen]
        start = _stable_hash(f"alt:{len(tokens)}") % len(others)
        alts = [others[(start + r) % len(others)] for r in range(max(k - 1, 0))]
        ids = [chosen] + ([chosen] if k > 0 else []) + alts
        lps = [top] + ([top] if k > 0 else []) + [top - 1.0 - r for r in range(len(alts))]
        ranks = [1] + ([1] if k > 0 else []) + list(range(2, 2 + len(alts)))
        return TokenLogprobs(token_ids=ids, logprobs=lps, ranks=ranks)

    def expected_token_ids(self, prompt_token_ids: list[int], params: SamplingParams, index: int = 0,
                           length: int | None = None) -> list[int]:
        """The first `length` (default max_tokens) tokens sample `index` generates, before stop strings
        (the engine gives sample i of a seeded request the seed `seed + i`)."""
        if params.seed is not None and index:
            params = msgspec.structs.replace(params, seed=params.seed + index)
        tokens = list(prompt_token_ids)
        for _ in range(length or params.max_tokens or 16):
            tokens.append(self.next_token(tokens, len(prompt_token_ids), params))
        return tokens[len(prompt_token_ids):]


class _Seq:
    def __init__(self, tokens: list[int], num_prompt: int, num_computed: int, params: SamplingParams):
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.num_computed = num_computed
        self.params = params


class FakeRunner:
    """The four runner methods over a FakeModel; keeps per-request state from the protocol alone."""

    def __init__(self, config: AserveConfig, model: FakeModel):
        self.config = config
        self.model = model
        self.seqs: dict[str, _Seq] = {}
        self.loaded = False

    def load_model(self) -> None:
        self.loaded = True  # no weights: the FakeModel is the model

    def initialize_kv_cache(self) -> RunnerInfo:
        return RunnerInfo(num_blocks=self.model.num_blocks, num_cpu_blocks=0, block_size=self.config.cache.block_size,
                          kv_bytes_per_block=1024, device="cpu", attention_backend="fake")

    def capture_graphs(self) -> None:
        pass

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        model = self.model
        model.wait_if_paused()
        if model.step_delay:
            time.sleep(model.step_delay)
        if model.fatal is not None:
            raise model.fatal
        model.num_steps += 1
        for req_id in so.finished_req_ids:
            self.seqs.pop(req_id, None)
        for new in so.new_requests:
            self.seqs[new.req_id] = _Seq(list(new.prompt_token_ids) + list(new.output_token_ids),
                                         len(new.prompt_token_ids), new.num_computed_tokens, new.sampling_params)
        for cached in so.cached_requests:
            self.seqs[cached.req_id].num_computed = cached.num_computed_tokens
        out = RunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs={}, failed_requests={})
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens, strict=True):
            seq = self.seqs[req_id]
            start, seq.num_computed = seq.num_computed, seq.num_computed + n
            params = seq.params
            if params.prompt_logprobs is not None:
                positions = range(max(start, 1), min(seq.num_computed, seq.num_prompt))
                if positions:
                    out.prompt_logprobs[req_id] = [
                        model.logprobs(seq.tokens[:p], seq.tokens[p], params.prompt_logprobs) for p in positions]
            if seq.num_computed < len(seq.tokens):
                continue  # a chunk of the prompt: nothing to sample yet
            message = model.fail_if(req_id, seq.tokens[:seq.num_prompt]) if model.fail_if else None
            if message is not None:
                out.failed_requests[req_id] = message
                out.prompt_logprobs.pop(req_id, None)
                del self.seqs[req_id]
                continue
            token = model.next_token(seq.tokens, seq.num_prompt, params)
            out.req_ids.append(req_id)
            out.sampled_token_ids.append([token])
            out.logprobs.append([] if params.logprobs is None else
                                [model.logprobs(seq.tokens, token, params.logprobs)])
            seq.tokens.append(token)
        return out


def fake_executor_factory(model: FakeModel, executors: list | None = None) -> Callable[[AserveConfig], ThreadExecutor]:
    """An `executor_factory` whose ThreadExecutor runs FakeRunners over `model`; each executor made
    is appended to `executors` when given."""

    def factory(config: AserveConfig) -> ThreadExecutor:
        executor = ThreadExecutor(config, lambda c: FakeRunner(c, model))
        if executors is not None:
            executors.append(executor)
        return executor

    return factory
