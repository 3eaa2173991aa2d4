"""Test-only support for kvpush: what the tests and the fault benchmarks plug into the
engine, kept out of the production package ``kvpush``.

* ``faults``: ``FaultPlan`` (lost, delayed, corrupted side-channel messages; failed and
  slow transfers) and ``$KVPUSH_FAULTS``, which arms one in every connector of a
  ``kvpush serve`` started by the fault tests;
* ``inproc_transport``: ``InProcTransport``, a KV transport between engines of one
  process (``--kv-transport inproc``, hidden: tests only).

Nothing in ``kvpush`` imports this package unless a test asks for it (the inproc
transport, or ``$KVPUSH_FAULTS``).
"""
