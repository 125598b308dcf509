"""Public path of the elastic-training API (recovery from lost ranks under torchrun, state in
DCP checkpoints, each rank's engine from the planner's answer); the code is in
``parallel/elastic.py``."""
from .parallel.elastic import (Checkpoints, GlobalBatches, engine_for, global_loss,
                               reduce_gradients, restart_count)

__all__ = ["Checkpoints", "GlobalBatches", "engine_for", "global_loss", "reduce_gradients",
           "restart_count"]
