"""Tensor parallelism inside one instance: rank 0 (the engine core's step loop) and the
rank processes it starts (``kvpush.engine.rank_proc``).

Reading order: ``plan.py`` (what rank 0 sends the other ranks each step: typed msgspec
messages, never pickled calls), ``group.py`` (rank 0's side: starting the ranks, the
process group, sending the plan, noticing a rank's death). The weights' split is
``kvpush.model.parallel``.
"""
