"""The P/D router (`kvpush router`): an OpenAI-compatible front that sends each request's
prefill and decode legs (push: at once; pull: one after the other) to healthy instances.

Modules: ``config`` (flags as plain data), ``pool`` (instances, identity from /kv/info,
health, policies), ``legs`` (push/pull/colocated orchestration) and ``job`` (one
request's state), ``watch`` (waits ended by a failed health check), ``intake`` (body
limit, JSON the legs can carry, the outstanding-request bound), ``redact`` and ``wire``
(what reaches the wire and the client), ``metrics``, ``app`` (FastAPI front,
:class:`~kvpush.router.app.Router`), ``cli``. Nothing heavy is imported
here, so ``kvpush --help`` stays fast.
"""
