"""The P/D router (`kvpush router`): an OpenAI-compatible front that sends each request's
prefill and decode legs (push: at once; pull: one after the other) to healthy instances.

Modules: ``config`` (flags as plain data), ``pool`` (instances, identity from /kv/info,
health), ``placement`` (which instance takes a leg; the cache-aware policy with
``decide`` and ``kv_index``), ``life`` (one request's life: legs, retries, migration,
outcome) over ``senders`` (engine cores) and ``http_sender`` (vLLM), ``front`` (the
OpenAI front over the life), ``job`` (one request's record), ``watch``, ``intake``,
``redact`` and ``wire`` (what reaches the wire and the client), ``metrics``, ``app``
(the FastAPI app, :class:`~kvpush.router.app.Router`), ``cli``. Nothing heavy is
imported here, so ``kvpush --help`` stays fast.
"""
