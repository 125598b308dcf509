"""Scripts that tests/test_cuda.py runs in a child interpreter under the CUDA sanitizer
(``python -c``). They are kept here so a CPU test (test_csan_scripts.py) can compile them and
check their imports: a script that does not parse fails on a GPU only, as an ``IndentationError``
that looks like a test failure, not a data race.

Each script is written indented and dedented: every line, imports included, must carry the same
indentation, or ``textwrap.dedent`` removes nothing.
"""
import textwrap

CSAN_SCENARIO = textwrap.dedent("""
    import sys
    import torch
    import torch.cuda._sanitizer as csan
    assert csan.cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER=1 did not enable the sanitizer"

    from chameleon_swap.config import POLICIES
    from chameleon_swap.workloads import Llama, LlamaConfig
    from _helpers import compare
    from _models import ViewsModel, randn

    def tokens(cfg, B, T, seed):
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(cfg.vocab_size, (B, T + 1), generator=g)
        return t[:, :-1].cuda(), t[:, 1:].cuda()

    torch.manual_seed(0)
    llama = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              max_seq_len=64)).cuda()
    lm = [tokens(llama.config, 2, T, i) for i, T in enumerate([12, 20, 12])]
    views = ViewsModel().cuda()
    dense = [(randn(2, T, 16, seed=i).cuda(),) for i, T in enumerate([6, 11, 6])]
    for policy in POLICIES:
        for fraction in (0.5, 0.2, 0.0):
            compare(llama, lm, fraction, device="cuda", policy=policy)
            compare(views, dense, fraction, device="cuda", policy=policy)
    torch.cuda.synchronize()
    print("CSAN-SCENARIO-OK", flush=True)
""")

CSAN_RACE = textwrap.dedent("""
    import torch
    a = torch.rand(10000, device="cuda")          # written on the default stream
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.mul(a, 5, out=a)                    # and on another, with no ordering between them
    torch.cuda.synchronize()
    print("RACE-NOT-REPORTED", flush=True)
""")
