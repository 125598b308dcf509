"""Public path of the elastic-training API (recovery from lost ranks under torchrun, state in
DCP checkpoints); the code is in ``parallel/elastic.py``."""
from .parallel.elastic import (Checkpoints, GlobalBatches, global_loss, reduce_gradients,
                               restart_count)

__all__ = ["Checkpoints", "GlobalBatches", "global_loss", "reduce_gradients", "restart_count"]
