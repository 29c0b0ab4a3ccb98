"""Checks of the scheduler's engine arguments (how prefills share a step, multi-step decode, the
scheduler class), on an `EngineArgs` before anything is resolved. Standard library only."""

from __future__ import annotations

import math
import re
from typing import Any

from aserve.config.errors import require

_DOTTED_CLASS = re.compile(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*")


def check_scheduler_args(args: Any) -> None:
    """ConfigError naming the flag for an out-of-range value or a combination not built."""
    require(math.isfinite(args.scheduler_delay_factor) and args.scheduler_delay_factor >= 0,
            "scheduler_delay_factor", f"must be a finite number >= 0, got {args.scheduler_delay_factor}")
    require(args.max_num_partial_prefills >= 1, "max_num_partial_prefills",
            f"must be >= 1, got {args.max_num_partial_prefills}")
    require(1 <= args.max_long_partial_prefills <= args.max_num_partial_prefills, "max_long_partial_prefills",
            f"must be in [1, max_num_partial_prefills={args.max_num_partial_prefills}], "
            f"got {args.max_long_partial_prefills}")
    require(args.scheduler_cls is None or _DOTTED_CLASS.fullmatch(args.scheduler_cls) is not None, "scheduler_cls",
            f"must be a dotted path 'package.module.Class', got {args.scheduler_cls!r}")
    require(args.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
            f"must be >= 0, got {args.long_prefill_token_threshold}")
    require(args.num_scheduler_steps >= 1, "num_scheduler_steps", f"must be >= 1, got {args.num_scheduler_steps}")
    if args.num_scheduler_steps > 1:
        # As in vLLM: a multi-step call runs N plain decode steps; verification steps are a different shape.
        require(not args.speculative_config, "num_scheduler_steps",
                f"{args.num_scheduler_steps} (multi-step decode) cannot be combined with speculative decoding "
                "(--speculative-config); use one or the other")
    if args.async_scheduling:  # the next step is scheduled before this one's tokens are known
        refused = [("speculative_config", args.speculative_config is not None, "speculative decoding (drafts "
                    "come back with each step's output)"),
                   ("num_scheduler_steps", args.num_scheduler_steps > 1, "multi-step decode"),
                   ("pipeline_parallel_size", args.pipeline_parallel_size > 1, "pipeline parallelism (its steps "
                    "are already in flight together)")]
        for flag, given, what in refused:
            require(not given, "async_scheduling", f"cannot be combined with {what} (--{flag.replace('_', '-')})")
