"""KV transfer between a prefill and a decode instance: push (prefill WRITEs into
decode's blocks) and pull (decode READs prefill's lent blocks).

Two threads per instance. The **step loop** (the engine's) owns every block and every
request; the **transfer thread** owns the side channel, the transport, the peers, the
leases and the fences. Once per engine turn the step loop hands the transfer thread one
``StepMessage`` (its commands, in order) and gets back, through the engine's inbox, one
``TransferUpdate`` per pass of the transfer thread (its events, in order).

Reading order, by concern:

1. **The contract of the two threads**: ``commands.py`` (commands, ``StepMessage``,
   events, ``TransferUpdate``, and the actions the connector hands the engine).
2. **The step loop's side**: ``connector.py`` (``KVConnector``: the engine's hooks, and
   the dispatch of each event), ``context.py`` (what its two halves share, the outbox),
   ``prefill_side.py`` (push sends, the layer hook, pull lends), ``decode_side.py``
   (receives, fenced blocks), ``thread_death.py`` (what a dead transfer thread's
   transfers become), ``state.py`` (per-transfer records, their states, the request's
   ``kv_transfer_params``).
3. **The transfer thread**: ``worker.py`` (``TransferWorker``: its loop, leases,
   heartbeats, the messages of peers), ``peers.py`` (handshakes, refusals, eviction),
   ``inflight.py`` (WRITEs and READs posted, their completions, PushDone / AbortAck /
   PullDone), ``lend_claims.py`` (a pull lend claimed once before its READ),
   ``fences.py`` (decode's wait for a push that may still land),
   ``timeline.py`` (the hand-off's stage stamps).
4. **Wire and authentication**: ``messages.py`` (the side channel's msgspec messages),
   ``side_channel.py`` with ``link_watch.py`` (ZMQ ROUTER/DEALER, connection drops),
   ``curve.py`` (CURVE keys derived from the secret, ZAP), ``channel_auth.py`` (signed
   messages), ``grants.py`` (the router's signature on
   ``kv_transfer_params``).
5. **Transports**: ``transport.py`` (the interface, descriptors from block ids),
   ``nixl_transport.py`` (NIXL over UCX). The in-process transport and the fault
   injection of the tests live outside this package, in ``kvpush_testing``.
"""
