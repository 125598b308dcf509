"""chameleon_swap.integrations.lightning: the callback in a lightning.pytorch Trainer with
gradient accumulation, on a tiny LlamaForCausalLM built from a config (no download).

The same module is trained on the same batches with and without the callback; every loss and
every parameter afterwards must be bitwise equal, each engine step must span one optimizer step
(all its accumulated batches), hold its budget and have moved bytes, and the figures must reach
the Trainer's logger.
"""
from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from chameleon_swap.integrations import lightning as cs_pl  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BUDGET = 16 * 1024
ACCUM, BATCHES = 2, 5          # 5 batches: two full accumulations, then one batch on its own


class TinyLlama(pl.LightningModule):
    def __init__(self, fail_at=None):
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64)
        self.model = transformers.LlamaForCausalLM(cfg)
        self.losses = []
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("training_step failed")
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class Recorder(pl.loggers.Logger):
    def __init__(self):
        super().__init__()
        self.metrics = []

    name = "recorder"
    version = 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))


def loader():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(64, (2 * BATCHES, 16), generator=g)
    return torch.utils.data.DataLoader(data, batch_size=2)


def fit(callback=None, module=None):
    module = module or TinyLlama()
    logger = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=ACCUM,
                         callbacks=[callback] if callback else [], logger=logger,
                         log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader())
    return module, logger


def test_fit_bitwise_budget_and_logs():
    ref, _ = fit()
    cb = cs_pl.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    module, logger = fit(cb)
    assert len(module.losses) == BATCHES
    assert all(torch.equal(a, b) for a, b in zip(ref.losses, module.losses))
    for (n, p), (_, q) in zip(ref.named_parameters(), module.named_parameters()):
        assert torch.equal(p, q), f"parameter {n} differs after training"
    hist = cb.engine.history
    assert len(hist) == 3                        # optimizer steps: batches (0,1), (2,3), (4)
    assert hist[0].saved_bytes >= 2 * hist[2].saved_bytes
    for s in hist:
        assert not s.failed and s.offloaded_bytes > 0
        assert s.peak_resident_bytes <= s.budget_bytes == BUDGET
    logged = [m["chameleon/peak_resident_bytes"] for m in logger.metrics
              if "chameleon/peak_resident_bytes" in m]
    assert logged == [float(s.peak_resident_bytes) for s in hist]
    assert cb.engine._closed and cb.engine.host_bytes_in_use == 0


def test_exception_releases_the_step():
    cb = cs_pl.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    with pytest.raises(RuntimeError, match="training_step failed"):
        fit(cb, TinyLlama(fail_at=3))            # 2nd batch of the 2nd optimizer step
    assert [s.failed for s in cb.engine.history] == [False, True]
    assert cb.engine.host_bytes_in_use == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_module_is_passed_where_the_engine_takes_model(monkeypatch):
    import chameleon_swap as cs
    seen = []

    class WithModel(cs.Chameleon):
        def __init__(self, budget=None, *, model=None, **kwargs):
            seen.append((model, kwargs.get("device")))
            super().__init__(budget, **kwargs)

    monkeypatch.setattr(cs, "Chameleon", WithModel)
    cb = cs_pl.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0)
    module, _ = fit(cb)
    assert seen == [(module, module.device)]
    assert len(cb.engine.history) == 3
