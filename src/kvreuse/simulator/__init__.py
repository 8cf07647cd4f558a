"""Trace simulator: replays request traces through the real ``BlockPool`` (no model, no tensors).

``traces`` reads traces into block keys, ``replay`` runs them through a pool and policy,
``belady`` is the offline reference, ``plot`` draws capacity sweeps, ``cli`` is
``kvreuse simulate``.
"""
