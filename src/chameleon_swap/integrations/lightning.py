"""PyTorch Lightning (``lightning.pytorch``): every optimizer step (all the batches of a gradient
accumulation) runs inside one ``eng.step()``. Needs the ``[lightning]`` extra.

::

    from chameleon_swap.integrations.lightning import ChameleonCallback

    cb = ChameleonCallback(budget="6GiB")          # any chameleon_swap.Chameleon keyword
    trainer = lightning.pytorch.Trainer(callbacks=[cb], accumulate_grad_batches=4)
    trainer.fit(module, loader)

Lightning runs forward and backward of a batch (automatic optimization) between
``on_train_batch_start`` and ``on_train_batch_end``, and steps the optimizer inside the last
batch of an accumulation. The step is entered at the first batch's start and left at the end of
the batch after which Lightning steps the optimizer (its own accumulation rule); an epoch that
ends mid-accumulation leaves it at ``on_train_epoch_end``, and ``on_exception`` releases it as
failed. Figures go through ``pl_module.log`` under ``chameleon/...`` once per engine step, so
they reach whatever logger the Trainer has.
"""
from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import Callback

from ._common import StepSpan, check_engine_kwargs, figures, make_engine


class ChameleonCallback(Callback):
    """Run each optimizer step of a ``lightning.pytorch.Trainer`` under a
    ``chameleon_swap.Chameleon``.

    Args:
        **engine_kwargs: the keyword arguments of ``chameleon_swap.Chameleon``. ``device``
            defaults to the LightningModule's device, and the module is passed as ``model=``
            where the engine accepts it.

    ``engine.history`` keeps one ``StepStats`` per optimizer step; the engine is closed when
    training ends or fails.
    """

    def __init__(self, **engine_kwargs) -> None:
        check_engine_kwargs(engine_kwargs, "ChameleonCallback")
        self.engine_kwargs = engine_kwargs
        self.engine = None
        self._span = StepSpan()

    def close(self, exc: Optional[BaseException] = None) -> None:
        """Leave an open step (as failed when ``exc`` is given) and close the engine."""
        try:
            self._span.close(exc)
        finally:
            if self.engine is not None:
                self.engine.close()

    def on_train_start(self, trainer, pl_module) -> None:
        self.close(RuntimeError("training ended by an exception inside this step"))
        self.engine = make_engine(self.engine_kwargs, model=pl_module, device=pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._span.is_open:
            self._span.open(self.engine)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if _steps_optimizer(trainer, batch_idx):
            self._end_step(pl_module, on_step=True)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # Lightning accepts only epoch-level logging from this hook.
        self._end_step(pl_module, on_step=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.close(exception)

    def _end_step(self, pl_module, on_step: bool) -> None:
        if not self._span.close():
            return
        for key, value in figures([self.engine.last_step]).items():
            pl_module.log(key, value, on_step=on_step, on_epoch=not on_step)


def _steps_optimizer(trainer, batch_idx: int) -> bool:
    """Whether Lightning steps the optimizer at the end of this batch. Lightning's own rule where
    this version exposes it (``ready`` batches already count this one here), else the same rule
    from public attributes."""
    should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
    if callable(should_accumulate):
        return not should_accumulate()
    return ((batch_idx + 1) % trainer.accumulate_grad_batches == 0
            or batch_idx + 1 == trainer.num_training_batches)
