"""chameleon_swap.integrations.transformers: the Trainer callback, and the engine in an
Accelerate-prepared loop, on a tiny LlamaForCausalLM built from a config (no download).

Each run trains the same model on the same batches with and without the engine, with gradient
accumulation; the logged losses and every parameter after training must be bitwise equal (any
gradient that differed on any step would show in the parameters), every engine step must hold
its budget and have moved bytes, and the figures must reach the Trainer's logs.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")     # the Trainer needs it

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.integrations import transformers as cs_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BUDGET = 16 * 1024            # far under a step's natural peak (~10x that): the engine must move
ACCUM, MAX_STEPS = 2, 3


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def dataset(n=ACCUM * MAX_STEPS * 2, seq=16):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": t, "labels": t} for t in torch.randint(64, (n, seq), generator=g)]


class Recorder(transformers.TrainerCallback):
    """Stands in for a reporting callback (TensorBoard, W&B): keeps what each on_log hands it."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def train(tmp_path, callback=None, model=None, attach=True):
    model = model if model is not None else tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM, max_steps=MAX_STEPS, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    recorder = Recorder()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(),
                                   callbacks=[recorder])
    if callback is not None and attach:
        callback.attach(trainer)
    elif callback is not None:
        trainer.add_callback(callback)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, trainer, recorder


def assert_same_params(a, b):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), f"parameter {n} differs after training"


def test_trainer_bitwise_budget_and_logs(tmp_path):
    ref_model, ref_losses, _, _ = train(tmp_path / "ref")
    cb = cs_hf.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    model, losses, trainer, recorder = train(tmp_path / "eng", cb)
    assert losses == ref_losses and len(losses) == MAX_STEPS
    assert_same_params(ref_model, model)
    hist = cb.engine.history
    assert len(hist) == MAX_STEPS                 # one engine step per optimizer step
    for s in hist:
        assert not s.failed
        assert s.peak_resident_bytes <= s.budget_bytes == BUDGET
        assert s.offloaded_bytes > 0
    # Both micro-batches of an accumulation ran inside the step: it saved at least twice what one
    # micro-step saves (the Trainer's loss scaling saves a few scalars more).
    probe = cs.Chameleon(None, device="cpu", min_tensor_bytes=0)
    with probe, probe.step():
        batch = transformers.default_data_collator(dataset()[:2])
        tiny_llama()(**batch).loss.backward()
    assert 2 * probe.last_step.saved_bytes <= hist[0].saved_bytes < 3 * probe.last_step.saved_bytes
    # Figures in log_history, and a reporting callback registered before ours received them.
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["chameleon/peak_resident_bytes"] for h in logged] == \
        [float(s.peak_resident_bytes) for s in hist]
    assert [r["chameleon/offloaded_bytes"] for r in recorder.logs if "loss" in r] == \
        [float(s.offloaded_bytes) for s in hist]
    assert all(r["chameleon/budget_bytes"] == BUDGET for r in recorder.logs if "loss" in r)
    assert cb.engine._closed and cb.engine.host_bytes_in_use == 0


def test_add_callback_reaches_logs_after_reporters(tmp_path):
    """Registered the Trainer's usual way the figures still reach log_history (the console),
    but not a reporter that ran before this callback: what attach() is for."""
    cb = cs_hf.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    _, _, trainer, recorder = train(tmp_path, cb, attach=False)
    assert all("chameleon/peak_resident_bytes" in h
               for h in trainer.state.log_history if "loss" in h)
    assert not any("chameleon/peak_resident_bytes" in r for r in recorder.logs)


class Boom(RuntimeError):
    pass


def test_exception_releases_the_step(tmp_path):
    model = tiny_llama()
    calls = {"n": 0}

    def fail_once_in_step_two(module, args):
        calls["n"] += 1
        if calls["n"] == ACCUM + 2:              # 2nd micro-batch of the 2nd optimizer step
            raise Boom("forward failed")

    model.model.layers[1].register_forward_pre_hook(fail_once_in_step_two)
    cb = cs_hf.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    with pytest.raises(Boom), cb:
        train(tmp_path, cb, model=model)
    assert [s.failed for s in cb.engine.history] == [False, True]
    assert cb.engine.host_bytes_in_use == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with pytest.raises(RuntimeError, match="closed"):
        with cb.engine.step():
            pass


def test_model_is_passed_only_where_the_engine_takes_it(monkeypatch, tmp_path):
    seen = []

    class WithModel(cs.Chameleon):
        def __init__(self, budget=None, *, model=None, **kwargs):
            seen.append(model)
            super().__init__(budget, **kwargs)

    monkeypatch.setattr(cs, "Chameleon", WithModel)
    cb = cs_hf.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
    model, *_ = train(tmp_path, cb)
    assert len(seen) == 1 and seen[0] is model
    monkeypatch.undo()
    if "model" not in __import__("inspect").signature(cs.Chameleon).parameters:
        assert cs_hf.ChameleonCallback(budget=1).engine_kwargs == {"budget": 1}
        cb = cs_hf.ChameleonCallback(budget=BUDGET, min_tensor_bytes=0, device="cpu")
        train(tmp_path / "plain", cb)         # builds the engine without model=
        assert len(cb.engine.history) == MAX_STEPS


def test_unknown_engine_keyword_fails_at_construction():
    with pytest.raises(TypeError, match="ChameleonCallback.*budgett"):
        cs_hf.ChameleonCallback(budgett="1GiB")


# ---------------------------------------------------------------------------- Accelerate
def accelerate_run(use_engine: bool):
    import accelerate
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(dataset(ACCUM * MAX_STEPS * 2), batch_size=2,
                                         collate_fn=transformers.default_data_collator)
    model, opt, loader = acc.prepare(model, opt, loader)
    eng = cs.Chameleon(BUDGET, device="cpu", min_tensor_bytes=0) if use_engine else None
    losses, batches = [], iter(loader)
    try:
        for _ in range(MAX_STEPS):
            with (eng.step() if eng is not None else torch.enable_grad()):
                for _ in range(ACCUM):
                    with acc.accumulate(model):
                        loss = model(**next(batches)).loss
                        acc.backward(loss)
                        opt.step()
                        opt.zero_grad()
                    losses.append(loss.detach())
    finally:
        if eng is not None:
            eng.close()
    return acc.unwrap_model(model), losses, eng


def test_accelerate_loop_bitwise_and_budget():
    ref_model, ref_losses, _ = accelerate_run(False)
    model, losses, eng = accelerate_run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert len(losses) == ACCUM * MAX_STEPS
    assert_same_params(ref_model, model)
    assert len(eng.history) == MAX_STEPS
    assert all(s.peak_resident_bytes <= BUDGET and s.offloaded_bytes > 0 for s in eng.history)
