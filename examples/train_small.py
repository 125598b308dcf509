"""Train a small Llama-style model for a few steps under an activation budget and print StepStats.

    python examples/train_small.py [--steps 8] [--budget-fraction 0.3] [--device cpu]

The budget is a fraction of the step's natural saved-activation peak (measured on the first batch),
and every loss is checked against the same training run without the engine, bit for bit.
"""
from __future__ import annotations

import argparse
import copy

import torch

import chameleon_swap as cs
from chameleon_swap.workloads import Llama, LlamaConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--budget-fraction", type=float, default=0.3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if not 0 <= args.budget_fraction <= 1:
        p.error("--budget-fraction must be between 0 and 1")

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256)
    model = Llama(cfg).to(args.device)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)

    def batch(step: int):
        seq = [256, 192, 128, 224][step % 4]            # the sequence length changes every step
        tokens = torch.randint(0, cfg.vocab_size, (4, seq + 1), generator=gen).to(args.device)
        return tokens[:, :-1], tokens[:, 1:]

    # The natural peak: one step with no budget, counting every saved storage.
    with cs.Chameleon(None, device=args.device, min_tensor_bytes=0) as probe:
        with probe.step():
            copy.deepcopy(model)(*batch(0)).backward()
        natural = probe.last_step.peak_resident_bytes
    gen.manual_seed(1)
    budget = int(natural * args.budget_fraction)
    print(f"natural activation peak {cs.format_bytes(natural)}; budget {cs.format_bytes(budget)}")

    identical = True
    with cs.Chameleon(budget, device=args.device, min_tensor_bytes=0) as eng:
        for step in range(args.steps):
            x, y = batch(step)
            with eng.step():
                loss = model(x, y)
                loss.backward()
            opt.step(); opt.zero_grad(set_to_none=True)
            ref_loss = reference(x, y)
            ref_loss.backward()
            ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
            same = torch.equal(loss.detach(), ref_loss.detach())
            identical &= same
            print(f"loss {loss.item():.4f} ({'identical' if same else 'DIFFERENT'}) | {eng.last_step}")
    held = all(s.peak_resident_bytes <= budget for s in eng.history)
    print(f"budget held on every step: {held}; losses identical to the run without the engine: {identical}")
    return 0 if held and identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
