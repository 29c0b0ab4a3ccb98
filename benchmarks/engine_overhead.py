"""The engine's own time per step, without a model: scheduling, applying the step's tokens, output
processing (detokenizing, stop checks) at a given batch size. On a GPU a 1B model's decode step at
batch 128 takes a couple of milliseconds, so this is the part that decides offline throughput there;
it runs the same on any machine.

    python benchmarks/engine_overhead.py                      # 128 requests x 512 in / 256 out
    python benchmarks/engine_overhead.py --num-prompts 256 --profile

The runner is a stand-in that answers each step instantly with one token per sampling request (a
whole-word token, never EOS), through the real ThreadExecutor, LLMEngine and scheduler. Reports
milliseconds per step and output tokens per second; `--profile` adds cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve.engine.llm_engine import LLMEngine  # noqa: E402
from aserve.sampling_params import SamplingParams  # noqa: E402
from tests.support.fake_model import FakeModel, build_model_folder, engine_args, fake_executor_factory  # noqa: E402


class InstantModel(FakeModel):
    """A FakeModel whose next token costs nothing to choose (the position picks a word)."""

    def next_token(self, tokens, num_prompt, params):
        return self.word_ids[len(tokens) % len(self.word_ids)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    folder = build_model_folder(tempfile.mkdtemp(), max_position_embeddings=args.input_len + args.output_len)
    model = InstantModel.for_folder(folder, num_blocks=args.num_prompts * (args.input_len + args.output_len) // 16 + 64)
    engine = LLMEngine.from_engine_args(
        engine_args(folder, max_model_len=args.input_len + args.output_len, max_num_seqs=max(args.num_prompts, 1),
                    max_num_batched_tokens=args.max_num_batched_tokens),
        executor_factory=fake_executor_factory(model))
    rng = random.Random(0)
    for i in range(args.num_prompts):
        ids = [rng.choice(model.word_ids) for _ in range(args.input_len)]
        engine.add_request(str(i), None, SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0),
                           prompt_token_ids=ids)
    profiler = cProfile.Profile() if args.profile else None
    steps, start = 0, time.perf_counter()
    if profiler:
        profiler.enable()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    print(f"{args.num_prompts} requests x {args.input_len} in / {args.output_len} out: {steps} steps in "
          f"{seconds:.2f} s, {seconds / steps * 1e3:.2f} ms per step, "
          f"{args.num_prompts * args.output_len / seconds:.0f} output tok/s (no model)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    engine.shutdown()


if __name__ == "__main__":
    main()
