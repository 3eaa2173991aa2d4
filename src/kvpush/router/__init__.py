"""The P/D router (`kvpush router`): an OpenAI-compatible front that sends each request's
prefill and decode legs (push: at once; pull: one after the other) to healthy instances.

Modules: ``config`` (flags as plain data), ``pool`` (instances, identity from /kv/info,
health, policies), ``legs`` (push/pull/colocated orchestration), ``metrics``, ``app``
(FastAPI front, :class:`~kvpush.router.app.Router`), ``cli``. Nothing heavy is imported
here, so ``kvpush --help`` stays fast.
"""
