"""Hugging Face ``Trainer``: every optimizer step (all its gradient-accumulation micro-steps) runs
inside one ``eng.step()``. Needs the ``[hf]`` extra.

::

    from chameleon_swap.integrations.transformers import ChameleonCallback

    cb = ChameleonCallback(budget="6GiB")          # any chameleon_swap.Chameleon keyword
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    cb.attach(trainer)        # ahead of TensorBoard/W&B, so they receive its figures too
    trainer.train()
    print(cb.engine.history)  # one StepStats per optimizer step

Which events bracket one optimizer step (transformers 4.4x-5.x, ``Trainer._inner_training_loop``):
``on_step_begin`` fires before the first micro-batch of an accumulation, ``on_substep_end`` after
each other one, then clipping, ``on_pre_optimizer_step``, ``optimizer.step()``, ``on_step_end``.
The step is entered at ``on_step_begin`` and left at ``on_pre_optimizer_step`` (every backward of
the accumulation has run; the optimizer saves nothing for backward), or at ``on_step_end`` on
versions without that event. A loop that breaks mid-accumulation (a callback asking to stop)
leaves it at ``on_epoch_end`` / ``on_train_end``.

The Trainer does not tell callbacks about an exception. Wrap ``train()`` in the callback
(``with cb: trainer.train()``) or call ``cb.close(exc)`` so a step that an exception interrupted
releases what it holds and its saved-tensor hooks are removed; a later ``train()`` with the same
callback does that too (the stale step counts as failed).

Accelerate without the Trainer: use the engine directly, one ``eng.step()`` around the
micro-batches of one optimizer step::

    eng = chameleon_swap.Chameleon(budget="6GiB")
    model, opt, loader = accelerator.prepare(model, opt, loader)
    batches = iter(loader)
    for update in range(num_updates):
        with eng.step():
            for _ in range(accumulation_steps):
                with accelerator.accumulate(model):
                    loss = model(**next(batches)).loss
                    accelerator.backward(loss)
                    opt.step(); opt.zero_grad()
    eng.close()
"""
from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

from ._common import StepSpan, check_engine_kwargs, figures, make_engine


class ChameleonCallback(TrainerCallback):
    """Run each optimizer step of a ``transformers.Trainer`` under a ``chameleon_swap.Chameleon``.

    Args:
        **engine_kwargs: the keyword arguments of ``chameleon_swap.Chameleon`` (``budget``,
            ``policy``, ...). ``device`` defaults to the Trainer's device, and the Trainer's model
            is passed as ``model=`` where the engine accepts it.

    Each engine step's ``StepStats`` go to ``engine.history``; at every Trainer log the steps
    since the last one are summarised under ``chameleon/...`` keys (peak resident bytes, bytes
    moved, synchronous fetches, stall and step seconds, budget) in the same ``logs`` dict as the
    loss, so they reach ``state.log_history``, the console and every reporting callback that runs
    after this one (see ``attach``). The engine is closed at the end of training.
    """

    def __init__(self, **engine_kwargs) -> None:
        check_engine_kwargs(engine_kwargs, "ChameleonCallback")
        self.engine_kwargs = engine_kwargs
        self.engine = None
        self._span = StepSpan()
        self._unlogged: list = []

    def attach(self, trainer) -> "ChameleonCallback":
        """Register this callback first in ``trainer``'s list. ``Trainer(callbacks=[cb])`` and
        ``trainer.add_callback(cb)`` put it after the reporting callbacks (TensorBoard, W&B, ...)
        that ``report_to`` creates, which then log before this callback adds its figures."""
        handler = trainer.callback_handler
        if self in handler.callbacks:
            handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        return self

    # ------------------------------------------------------------------ lifecycle
    def close(self, exc: Optional[BaseException] = None) -> None:
        """Leave an open step (as failed when ``exc`` is given) and close the engine: every host
        buffer is released and its hooks are removed. Safe to call more than once."""
        try:
            self._span.close(exc)
        finally:
            if self.engine is not None:
                self.engine.close()

    def __enter__(self) -> "ChameleonCallback":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A previous train() that raised may have left its step open: it failed.
        self.close(RuntimeError("training ended by an exception inside this step"))
        self.engine = make_engine(self.engine_kwargs, model=model, device=args.device)
        self._unlogged = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._end_step()          # defensive: a loop that skipped our closing events
        self._span.open(self.engine)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._end_step()

    def on_step_end(self, args, state, control, **kwargs):
        self._end_step()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        figs = figures(self._unlogged)
        if logs is None or not figs:
            return
        self._unlogged = []
        logs.update(figs)
        # Trainer.log copied `logs` into log_history just before this event: keep them together.
        if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items()
                                     if k not in figs):
            state.log_history[-1].update(figs)

    def _end_step(self) -> None:
        if self._span.close():
            self._unlogged.append(self.engine.last_step)
