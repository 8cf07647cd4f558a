"""Model helpers split out of :mod:`kvreuse.model_loader` (tiny random-weight test models)."""
