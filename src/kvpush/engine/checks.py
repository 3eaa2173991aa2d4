"""A request checked once, where it enters the instance: ``RequestChecker.check``.

Everything here depends on the configuration only (the model's vocabulary and context,
the block size, the instance's role, its cluster secret), so the front end runs it
before anything is queued, in whichever process it lives; the engine core trusts an
``AddRequest`` and checks only what depends on its live state (a request id in use, a
dead transfer thread). Errors are RequestError (HTTP 400; 403 for a bad signature).
"""

from __future__ import annotations

import dataclasses

from kvpush.config import EngineConfig
from kvpush.errors import RequestError
from kvpush.kv_cache.block_pool import hash_prompt_chain
from kvpush.kv_transfer.params import GivenKVParams, KVTransferParams, chain_problem
from kvpush.sampling_params import SamplingParams


class RequestChecker:
    def __init__(self, config: EngineConfig):
        kvt = config.kv_transfer
        self.role = kvt.role if kvt.enabled else "both"
        self.engine_id = kvt.engine_id if kvt.enabled else ""
        self.signer = None
        if kvt.enabled and kvt.params_signed:
            from kvpush.crypto.auth import ParamsSigner

            assert kvt.side_channel_secret is not None  # (params_signed says so)
            self.signer = ParamsSigner(kvt.side_channel_secret)
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model.vocab_size

    def kv_params(self, raw: object) -> KVTransferParams | None:
        """A request's ``kv_transfer_params`` checked once, typed (RequestError: a 400)."""
        if raw is None or isinstance(raw, KVTransferParams):
            return raw
        if self.role == "both":
            raise RequestError(
                "kv_transfer_params given, but this instance runs with --role both",
                "kv_transfer_params",
            )
        return KVTransferParams.parse(raw, self.role, self.signer, self.engine_id)

    def leg_params(self, params: SamplingParams,
                   kv: KVTransferParams | None) -> SamplingParams:
        """The sampling parameters the request runs with: a push or pull prefill leg
        ends with token #1, whose logprob travels with the KV (the one place that says
        so; the router sends max_tokens=1 too, as vLLM's proxies do), and one choice:
        decode forks the others from the prompt's KV, moved once."""
        if kv is not None and kv.do_remote_decode and self.role == "prefill":
            return dataclasses.replace(params, max_tokens=1, logprobs=True, n=1)
        return params

    def check(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: GivenKVParams | None = None,
    ) -> tuple[KVTransferParams | None, SamplingParams]:
        """Raise RequestError for a request this instance can never serve; returns its
        typed kv_transfer_params and the sampling parameters it runs with."""
        kv = self.kv_params(kv_transfer_params)
        params = self.leg_params(params, kv)
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n + params.max_tokens > self.max_model_len:  # before any per-token work
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {n + params.max_tokens} tokens ({n} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the "
                "prompt or max_tokens.",
                "max_tokens" if n < self.max_model_len else "prompt",
                "context_length_exceeded",
            )
        if kv is not None and kv.prompt_hashes is not None:
            # pull: the blocks prefill lent hold its prompt's KV; READ them only for it
            problem = chain_problem(
                kv.prompt_hashes, hash_prompt_chain(prompt_token_ids, self.block_size,
                                                   salt=params.cache_salt),
                "the lent KV's", "this request's")
            if problem:
                raise RequestError(f"kv_transfer_params: {problem}", "kv_transfer_params",
                                   "kv_prompt_mismatch")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size
               for t in prompt_token_ids):
            raise RequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt"
            )
        return kv, params
