"""Per-request block tables over the block pool: prefix-cache lookups, slot allocation, free, swap.

Caching rule: a request's full blocks are registered under their chained hash as soon as the step
that computes them is scheduled (the attention backend writes a step's K/V before any sequence of
that step attends), when prefix caching is enabled or the request has `share_prefix` set (the
members of an n > 1 group share their prompt blocks even with caching off). A registered block
whose tokens turn out not to be computed (the request is preempted in the step that scheduled them,
or the step failed) loses its hash when the request releases it.
"""

from __future__ import annotations

from aserve.core.block_pool import BlockPool
from aserve.core.hashing import HashFn, extend_block_hashes
from aserve.core.request import Request, RequestStatus


class KVCacheManager:
    """Device block tables (plus CPU block tables of swapped-out requests), keyed by request id."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        num_cpu_blocks: int = 0,
        hash_fn: HashFn = hash,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks: must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks, enable_caching)
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # a stack: pops 0 first
        self._blocks: dict[str, list[int]] = {}
        self._cpu_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already carrying a hash
        self.prefix_cache_queries = 0  # cumulative tokens looked up (once per admission)
        self.prefix_cache_hits = 0  # cumulative tokens found

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free device blocks still holding a cached prefix (counted in `num_free_blocks`)."""
        return self.pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable device blocks in use, 0..1."""
        return self.pool.num_used_blocks / self.pool.num_usable_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's device block table (a live list: do not mutate); [] when it has none."""
        return self._blocks.get(req_id, [])

    def get_cpu_block_ids(self, req_id: str) -> list[int]:
        return self._cpu_blocks.get(req_id, [])

    # -- prefix cache ----------------------------------------------------------------------------
    def _shares(self, request: Request) -> bool:
        return self.enable_caching or request.share_prefix

    def _ensure_hashes(self, request: Request) -> list[int]:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        if len(hashes) < len(tokens) // self.block_size:
            lora_id = request.lora_int_id
            extend_block_hashes(hashes, tokens, self.block_size, (lora_id,) if lora_id else None, self.hash_fn)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest chain of cached full blocks matching the request's leading tokens, and the
        number of tokens they hold. At least the last token is left to compute. Pass the blocks to
        `allocate_slots` before anything else allocates (they may be free cached blocks)."""
        if not self._shares(request) or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        if max_blocks <= 0:
            return [], 0
        hashes = self._ensure_hashes(request)
        tokens = request.all_token_ids
        lookup = self.pool.get_cached_block
        computed = []
        for i in range(max_blocks):
            block_id = lookup(hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
            if block_id is None:
                break
            computed.append(block_id)
        return computed, len(computed) * bs

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: list[int] | tuple[int, ...] = ()
    ) -> list[int] | None:
        """Ensures blocks for `request.num_computed_tokens + len(computed_block_ids) * block_size +
        num_new_tokens` tokens. On the first allocation the computed blocks (prefix hits from
        `get_computed_blocks`) start the block table. Returns the newly allocated block ids, or None
        (nothing changes) when there are not enough free blocks."""
        req_id = request.request_id
        bs = self.block_size
        blocks = self._blocks.get(req_id)
        if blocks is not None and not computed_block_ids:
            # Fast path (decodes): the table already covers the new tokens.
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * bs:
                if self.enable_caching or request.share_prefix:
                    self._register_full_blocks(request, blocks, min(num_tokens, request.num_tokens) // bs)
                return []
        first = blocks is None
        if first:
            blocks = []
        elif computed_block_ids:
            raise ValueError("computed_block_ids: only allowed on a request's first allocation")
        num_hit = len(computed_block_ids)
        num_tokens = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_new_blocks = -(-num_tokens // bs) - len(blocks) - num_hit
        pool = self.pool
        if num_new_blocks > 0 or num_hit:
            num_needed = max(num_new_blocks, 0)
            if num_hit:
                num_needed += sum(1 for b in computed_block_ids if pool.ref_cnt(b) == 0)
            if num_needed > pool.num_free_blocks:
                return None
        if first:
            self._blocks[req_id] = blocks
            self._num_registered[req_id] = num_hit
            if num_hit:
                pool.touch(computed_block_ids)
                blocks.extend(computed_block_ids)
                if self.enable_caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_hit * bs
            elif self.enable_caching and request.sampling_params.prompt_logprobs is None:
                self.prefix_cache_queries += request.num_tokens
        new_blocks = pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self._shares(request):
            self._register_full_blocks(request, blocks, min(num_tokens, request.num_tokens) // bs)
        return new_blocks

    def _register_full_blocks(self, request: Request, blocks: list[int], num_full: int) -> None:
        req_id = request.request_id
        start = self._num_registered[req_id]
        if num_full <= start:
            return
        bs = self.block_size
        hashes = self._ensure_hashes(request)
        tokens = request.all_token_ids
        cache = self.pool.cache_full_block
        for i in range(start, num_full):
            cache(blocks[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        self._num_registered[req_id] = num_full

    def _release(self, request: Request, blocks: list[int]) -> None:
        """Drops the request's references; blocks registered for tokens not computed lose their hash."""
        pool = self.pool
        num_valid = 0 if request.status == RequestStatus.FINISHED_ERROR else request.num_computed_tokens // self.block_size
        for i in range(num_valid, self._num_registered.get(request.request_id, 0)):
            if pool.ref_cnt(blocks[i]) == 1:
                pool.uncache_block(blocks[i])
        pool.free(reversed(blocks))

    def free(self, request: Request) -> None:
        """Releases the request's device and CPU blocks now; no-op for a request without blocks."""
        req_id = request.request_id
        blocks = self._blocks.get(req_id)
        if blocks is not None:
            self._release(request, blocks)
            del self._blocks[req_id]
            del self._num_registered[req_id]
        cpu_blocks = self._cpu_blocks.pop(req_id, None)
        if cpu_blocks is not None:
            self._cpu_free.extend(reversed(cpu_blocks))

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached hashes; False (nothing changes) while any block is in use."""
        return self.pool.reset_prefix_cache()

    # -- swap ------------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        blocks = self._blocks.get(request.request_id)
        return blocks is not None and len(blocks) <= len(self._cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copies every device block of the request to a CPU block and releases the device blocks.
        Returns (device_block, cpu_block) pairs for the runner. Check `can_swap_out` first."""
        req_id = request.request_id
        blocks = self._blocks[req_id]
        if len(blocks) > len(self._cpu_free):
            raise RuntimeError(f"swap_out({req_id!r}): {len(blocks)} blocks, {len(self._cpu_free)} CPU blocks free")
        cpu_blocks = [self._cpu_free.pop() for _ in blocks]
        self._release(request, blocks)
        del self._blocks[req_id]
        del self._num_registered[req_id]
        self._cpu_blocks[req_id] = cpu_blocks
        return list(zip(blocks, cpu_blocks))

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether the request's CPU blocks, plus room for `num_new_tokens` more tokens, fit on device."""
        cpu_blocks = self._cpu_blocks.get(request.request_id)
        if cpu_blocks is None:
            return False
        needed = max(len(cpu_blocks), -(-(request.num_computed_tokens + num_new_tokens) // self.block_size))
        return needed <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Moves the request's blocks back to newly allocated device blocks; returns (cpu_block,
        device_block) pairs for the runner. Check `can_swap_in` first."""
        req_id = request.request_id
        cpu_blocks = self._cpu_blocks[req_id]
        blocks = self.pool.allocate(len(cpu_blocks))
        if blocks is None:
            raise RuntimeError(f"swap_in({req_id!r}): {len(cpu_blocks)} blocks needed, "
                               f"{self.pool.num_free_blocks} free")
        del self._cpu_blocks[req_id]
        self._cpu_free.extend(reversed(cpu_blocks))
        self._blocks[req_id] = blocks
        self._num_registered[req_id] = 0
        if self._shares(request):
            self._register_full_blocks(request, blocks, request.num_computed_tokens // self.block_size)
        return list(zip(cpu_blocks, blocks))
