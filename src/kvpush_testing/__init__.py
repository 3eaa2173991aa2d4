"""Test-only support for kvpush, kept out of the production package ``kvpush`` and
injected from outside (``LLMEngine(config, links=...)``, ``CoreClient.launch(links=...)``):

* ``faults``: ``FaultPlan`` (lost and delayed side-channel messages; failed and slow
  transfers), shared by the doubles below;
* ``links``: ``InProcLinks`` (engines of one process), ``FaultyNixlLinks`` (NIXL with
  faults armed from plain knobs, picklable), ``FaultyChannel``, ``FaultyPosts``;
* ``inproc_transport``: ``InProcTransport``, a KV transport between engines of one
  process (memmove);
* ``serve``: ``python -m kvpush_testing.serve`` runs kvpush's own ``serve`` with such
  links (the fault matrix; a transfer thread that dies on cue).

Nothing in ``kvpush`` imports this package.
"""
