"""What pinning host memory costs on this machine, and what it holds up while it runs.

    python benchmarks/pinning.py [--device cuda] [--gib 2] [--chunk-mib 256] [--repeats 3]
    python benchmarks/pinning.py --quick          # the CPU, plain memory: a smoke run, seconds

Why: on the project's H100 leases the host arena's pinning is the largest cost left. The capped
schedule's first step took 44.9 s for half a second of work, the hybrid's first step 15 s, and
the arena pins about a GiB a second. What the arena should do about it turns on four facts only
a GPU host gives, measured here side by side, each repeated ``--repeats`` times (medians):

1. ``alloc``: ``--gib`` GiB pinned the arena's way, ``torch.empty(pin_memory=True)`` in chunks of
   ``--chunk-mib`` (torch's host allocator: ``cudaHostAlloc``), and handed back (``free``: the
   blocks dropped and torch's host cache emptied, as an engine's close does);
2. ``register``: the same bytes as plain memory whose pages all cores touch first (``fill_``
   runs on torch's intra-op threads), then ``cudaHostRegister`` per chunk (and unregistered).
   ik_llama.cpp's pull request 1988 reports this twice as fast as ``cudaMallocHost`` on its
   hosts (a fact from elsewhere, not this project's). Beside it ``alloc_torch_register``: the
   arena's way again in a child process whose ``PYTORCH_CUDA_ALLOC_CONF`` turns on torch's own
   registering pinned allocator (``pinned_use_cuda_host_register``, 8 threads), a process-wide
   setting a user could make;
3. ``contention``: a launch-bound loop on the main thread (``--launches`` tiny kernels, then a
   synchronize) timed alone, and while another thread pins ``--gib`` GiB either way: whether
   pinning ahead on the arena's background thread holds up a step's launches (an earlier lease
   read a first step's figures that way; never measured apart);
4. ``d2h``: a ``--copy-mib`` MiB device tensor copied out into pinned memory, into plain memory
   already touched, and into plain memory never touched (the price of copying a cold step's
   tensors out without pinning for them).

On the CPU there is nothing to pin: ``alloc`` allocates and touches plain memory, ``register``
and ``d2h`` are skipped (None), ``contention`` runs the loop on CPU tensors beside a thread that
allocates. The CPU's figures stand for nothing on a GPU; the run checks the script end to end.

Writes ``benchmarks/results/pinning-<device>.json`` (environment, config, per-repeat figures and
medians) and a markdown table next to it. Estimate on an H100 host at the defaults: about 15 s a
repeat (2 GiB pinned twice at about a GiB a second, registered twice, touched and freed, and a
child process that starts CUDA and pins it once more), under a minute.
"""
from __future__ import annotations

import argparse
import gc
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from chameleon_swap.copy.host_pool import _empty_host_cache, aligned_host  # noqa: E402

GiB, MiB = 2**30, 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gib", type=float, default=2.0, help="GiB pinned per measurement")
    p.add_argument("--chunk-mib", type=int, default=256,
                   help="MiB per allocation (the arena's chunk: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--launches", type=int, default=2000, help="kernels per contention loop")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB copied out per d2h figure")
    p.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    if a.quick:
        a.gib, a.chunk_mib, a.repeats, a.launches, a.copy_mib = 0.125, 16, 1, 200, 16
    if not a.gib > 0:
        p.error(f"--gib must be a positive number of GiB; got {a.gib}")
    C.check_counts(p, a, ("chunk_mib", "repeats", "launches", "copy_mib"), ())
    a.chunk_bytes = a.chunk_mib * MiB
    a.chunks = max(1, int(a.gib * GiB) // a.chunk_bytes)
    return a


def alloc(a, cuda: bool) -> tuple[dict, list]:
    """The arena's way: chunks from torch's (pinned, on CUDA) allocator; on the CPU, touched."""
    t0 = C.now()
    held = [torch.empty(a.chunk_bytes, dtype=torch.uint8, pin_memory=cuda)
            for _ in range(a.chunks)]
    if not cuda:
        for t in held:
            t.fill_(0)
    return {"alloc_s": C.now() - t0}, held


def free(held: list, cuda: bool) -> dict:
    t0 = C.now()
    held.clear()
    gc.collect()
    if cuda:
        _empty_host_cache()
    return {"free_s": C.now() - t0}


def register(a) -> dict:
    """Plain chunks touched by all cores, then registered with the driver (and unregistered)."""
    cudart = torch.cuda.cudart()
    t0 = C.now()
    held = [aligned_host(a.chunk_bytes, pin=False) for _ in range(a.chunks)]
    for t in held:
        t.fill_(0)
    t1 = C.now()
    for t in held:
        torch.cuda.check_error(cudart.cudaHostRegister(t.data_ptr(), a.chunk_bytes, 0))
    t2 = C.now()
    reads_pinned = all(t.is_pinned() for t in held)     # what torch's copies go by
    for t in held:
        torch.cuda.check_error(cudart.cudaHostUnregister(t.data_ptr()))
    t3 = C.now()
    return {"touch_s": t1 - t0, "register_s": t2 - t1, "unregister_s": t3 - t2,
            "registered_reads_pinned": reads_pinned}


TORCH_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
_CHILD = """
import sys, time, torch
n, size = int(sys.argv[1]), int(sys.argv[2])
torch.cuda.init()
t0 = time.perf_counter()
held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
print(time.perf_counter() - t0)
"""


def alloc_torch_register(a) -> dict:
    """``alloc`` in a child process with torch's registering pinned allocator turned on; where
    this torch refuses the setting or the child fails, the child's last words instead."""
    import os
    import subprocess
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=TORCH_REGISTER)
    got = subprocess.run([sys.executable, "-c", _CHILD, str(a.chunks), str(a.chunk_bytes)],
                         env=env, capture_output=True, text=True, timeout=120)
    try:
        return {"alloc_torch_register_s": float(got.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {"alloc_torch_register_error": (got.stderr or got.stdout)[-300:]}


def _loop(device: torch.device, launches: int):
    x = torch.zeros(256, device=device)

    def run() -> float:
        C.sync(device)
        t0 = C.now()
        for _ in range(launches):
            x.add_(1.0)
        C.sync(device)
        return C.now() - t0
    return run


def contention(a, device: torch.device, cuda: bool) -> dict:
    """The loop alone, then while a thread pins (or, on the CPU, allocates) ``--gib`` GiB."""
    run = _loop(device, a.launches)
    run()                                                      # warm
    alone = [run() for _ in range(9)]
    out = {"alone_s": C.median(alone)}
    held: list = []          # what the pinning thread allocated: freed after it, untimed
    kinds = {"pin": lambda: held.extend(alloc(a, cuda)[1])}
    if cuda:
        kinds["register"] = lambda: register(a)      # (unregisters at its end, timed with it)
    for kind, work in kinds.items():
        th = threading.Thread(target=work, name=f"pinning-{kind}")
        during = []
        th.start()
        while th.is_alive():
            during.append(run())
        th.join()
        free(held, cuda)
        out[f"during_{kind}_s"] = C.median(during) if during else None
        out[f"during_{kind}_loops"] = len(during)
        out[f"during_{kind}_x_alone"] = (out[f"during_{kind}_s"] / out["alone_s"]
                                         if during else None)
    return out


def d2h(a, device: torch.device) -> dict:
    """GB/s copying a device tensor out into pinned, touched plain and untouched plain memory."""
    n = a.copy_mib * MiB
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dests = {"pinned": lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True),
             "plain_touched": lambda: aligned_host(n, pin=False).fill_(0),
             "plain_fresh": lambda: aligned_host(n, pin=False)}
    out = {}
    for name, make in dests.items():
        dst = make()
        C.sync(device)
        t0 = C.now()
        dst.copy_(src, non_blocking=name == "pinned")
        C.sync(device)
        out[f"{name}_gbps"] = n / (C.now() - t0) / 1e9
        del dst
    return out


def medians(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if isinstance(rows[0][k], float)]
    return {k: C.median(r[k] for r in rows if r.get(k) is not None) for k in keys}


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    pinned_gib = a.chunks * a.chunk_bytes / GiB
    rows = []
    with C.progress(a.repeats, f"pinning {pinned_gib:.2f} GiB on {C.device_name(device)}") as tick:
        for i in range(a.repeats):
            row: dict = {"repeat": i}
            got, held = alloc(a, cuda)
            row.update(got)
            row.update(free(held, cuda))
            row.update(register(a) if cuda else {})
            row.update(alloc_torch_register(a) if cuda else {})
            row.update(contention(a, device, cuda))
            row.update(d2h(a, device) if cuda else {})
            rows.append(row)
            tick()
    med = medians(rows)
    per_gib = {k.replace("_s", "_s_per_gib"): v / pinned_gib for k, v in med.items()
               if k in ("alloc_s", "free_s", "touch_s", "register_s", "unregister_s",
                        "alloc_torch_register_s")}
    config = {"gib": pinned_gib, "chunk_mib": a.chunk_mib, "chunks": a.chunks,
              "repeats": a.repeats, "launches": a.launches, "copy_mib": a.copy_mib,
              "intra_op_threads": torch.get_num_threads()}
    payload = {"benchmark": "pinning", "environment": C.environment(device), "config": config,
               "medians": med, "seconds_per_gib": per_gib, "repeats": rows}
    md = markdown(payload)
    path = C.write_results("pinning", device, payload, md, a.out)
    print(md)
    print(f"wrote {path}")
    return 0


def markdown(p: dict) -> str:
    env, cfg, med = p["environment"], p["config"], p["medians"]
    rows = [[k, v] for k, v in p["seconds_per_gib"].items()]
    rows += [[k, v] for k, v in med.items() if "during" in k or k == "alone_s" or "gbps" in k]
    return (f"# pinning on {env['device_name']}\n\n"
            f"torch {env['torch']}, commit {env['commit']}; {cfg['gib']:.2f} GiB in "
            f"{cfg['chunks']} chunks of {cfg['chunk_mib']} MiB, {cfg['repeats']} repeats "
            f"(medians), {cfg['intra_op_threads']} intra-op threads; a contention loop of "
            f"{cfg['launches']} launches.\n\n" + C.markdown_table(["figure", "median"], rows))


if __name__ == "__main__":
    sys.exit(main())
