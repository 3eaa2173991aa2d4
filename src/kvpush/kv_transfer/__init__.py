"""KV transfer between a prefill and a decode instance: push (prefill WRITEs into
decode's blocks) and pull (decode READs prefill's lent blocks).

Two threads per instance. The **step loop** (the engine's) owns every block and every
request; the **transfer thread** owns the side channel, the transport, the peers, the
leases and every transfer: on a push prefill instance each push (decode's registration
matched to the blocks the step loop states computed), on a decode instance each
receive (the registration or the READ, the fence). Once per engine turn the step loop
hands the transfer thread one ``StepMessage`` (facts, in order) and gets back, through
the engine's inbox, one ``TransferUpdate`` per pass of the transfer thread (the ends of
transfers, in order).

Reading order, one subpackage per concern:

1. ``commands.py``: the contract of the two threads (commands, ``StepMessage``, events,
   ``TransferUpdate``, the actions the connector hands the engine).
2. ``step_loop/``: the engine's side. ``connector.py`` (``KVConnector``: the engine's
   hooks and the dispatch of each event), ``context.py`` (what its two halves share,
   the outbox), ``prefill_side.py`` (the blocks of push sends, the layer hook that
   states them computed, pull lends),
   ``decode_side.py`` (the blocks of receives, fenced ones too), ``thread_death.py`` (what a dead
   transfer thread's transfers become), ``state.py`` (per-transfer records, their
   states, the request's ``kv_transfer_params``).
3. ``transfer_thread/``: ``worker.py`` (``TransferWorker``: its loop, the messages
   of peers), ``leases.py`` (per-transfer deadlines, heartbeats), ``peers.py``
   (handshakes, refusals, eviction), ``push_sends.py`` (a push prefill's transfers:
   registrations, which blocks go where, the end of each), ``inflight.py`` (WRITEs and
   READs posted, their completions, PushDone / AbortAck / PullDone), ``receives.py`` (a
   decode's transfers: params checked, registration or claim and READ, fence,
   prefill's answers) with ``registrations.py`` (re-sent when lost) and ``fences.py``
   (the wait for a push that may still land), ``lend_claims.py`` (a pull lend claimed
   once), ``teardown.py`` (how the thread ends, and tells its peers when it dies).
   ``timeline.py`` (here, beside ``commands.py``) holds the hand-off's stage stamps
   both threads write.
4. ``wire/``: between instances. ``messages.py`` (the side channel's msgspec
   messages), ``side_channel.py`` with ``link_watch.py`` (ZMQ ROUTER/DEALER,
   connection drops), ``curve.py`` (CURVE keys derived from the secret, ZAP),
   ``auth.py`` (grants: the router's signature on ``kv_transfer_params``; the HMAC on
   every channel message; the router's share of the keys).
5. ``transports/``: ``transport.py`` (the interface, descriptors from block ids),
   ``nixl_transport.py`` (NIXL over UCX). The in-process transport and the fault
   injection of the tests live outside this package, in ``kvpush_testing``.
"""
