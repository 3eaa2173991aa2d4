"""KV transfer between a prefill and a decode instance: push (prefill WRITEs into
decode's blocks) and pull (decode READs prefill's lent blocks).

Two threads per instance, and nothing shared between them but two queues. The **step
loop** (the engine's) owns every block and every request; per transfer it keeps only
the blocks it must give back (``step_loop/holds.py``). The **transfer thread** owns the
side channel, the transport, the peers and every transfer: one record each, one timer
heap, one role object chosen at start. Once per engine turn (or layer group) the step
loop states its facts in one ``StepMessage``; the transfer thread answers with
``TransferUpdate``s (a transfer ``Failing``, a transfer ``Over``; its counters) that
go into the engine's inbox.

Reading order:

1. ``commands.py``: the two threads' contract; ``params.py``: a request's
   ``kv_transfer_params``; ``record.py``: finished transfers and counters;
   ``links.py``: how an instance reaches its peers (injected).
2. ``step_loop/``: ``connector.py`` (the engine's hooks), ``holds.py``,
   ``prefill_side.py`` (push sends, pull lends, the layer hook), ``decode_side.py``.
3. ``transfer_thread/``: ``worker.py`` (the loop), ``table.py`` (records, phases,
   timers), ``context.py`` (what the roles share), ``push_prefill.py``,
   ``pull_prefill.py``, ``decode.py`` (the roles), ``peers.py`` (handshakes),
   ``posts.py`` (WRITEs and READs).
4. ``wire/``: ``messages.py`` (the side channel's messages), ``side_channel.py`` and
   ``link_watch.py`` (ZMQ ROUTER/DEALER, connection drops). Keys and MACs:
   ``kvpush.crypto``.
5. ``transports/``: ``transport.py`` (the interface, descriptors from block ids),
   ``nixl_transport.py``. Test doubles live in ``kvpush_testing``.
"""
