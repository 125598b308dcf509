"""Full recomputation of a block call: its forward records nothing, its backward runs it again.

torch's non-reentrant checkpoint runs the block's forward with autograd on: every operation
records a node and hands each tensor it saves to checkpoint's hook, which drops it. Here the
block's forward runs inside a custom autograd Function (``_Full``), under no_grad as a Function's
forward is, so nothing is recorded and nothing is saved but the call's own tensors (through the
engine's saved-tensor hooks: swappable like any other save). Its backward runs the block again
with autograd on, the forward's RNG states and autocast settings restored, and asks
``torch.autograd.grad`` for the gradients of what the outer backward needs of it
(``ctx.needs_input_grad``): the call's tensors and the block's parameters, which are the
Function's inputs too. So ``torch.autograd.grad`` and ``backward(inputs=...)`` work, parameters
get their gradients whether or not an input requires grad, and ``create_graph`` (a gradient
penalty) differentiates through the recompute; torch's reentrant checkpoint, which also runs the
forward under no_grad, has none of the three (its backward accumulates into ``.grad`` itself).

Measured (this project's 2-core CPU, torch 2.13, the demo's HF Llama 128 x 8 at 128 tokens,
every layer recomputed, one thread, 30 interleaved steps): 77.0 ms a step against 81.2 ms with
non-reentrant checkpointing (the plain step 60.3 ms), the same bits.

Leaves the block reaches that are not its parameters are found two ways. The parameters of modules
outside the block that its recompute calls (a shared module it calls but does not hold) come from
the runner's module probe in the recomputes it probes (``reached``; see below). Any other (a
parameter used without calling its module, a tensor in a closure) is found by walking the
recompute's graph (``walk``; 78 nodes for a layer of the demo's Llama at 160 tokens, 24 us alone
and 109-134 us inside a step on the 2-core CPU: see ``_foreign``): their gradients are accumulated
into their ``.grad`` by a nested ``torch.autograd.backward`` (what reentrant checkpoint does for all
of them), and ``on_found`` is told what was found, so that the runner passes them as the
Function's inputs too from the next call on, where their gradients go back through the outer
backward like the parameters'. Under the engine the runner walks every backward:
its recomputes after a block's first at a shape run with the engine's module hooks out of the way
(so without the probe; ``module_hooks.Quiet``), and the walk finds every leaf. A runner on its own
walks a block's first backward for each shape of its inputs, and every backward of a block once
found to reach leaves not its own; there, a leaf that is neither the block's nor a called module's,
reached for the first time on inputs of a shape already walked (a choice made on values, not
shapes), would miss its gradient in that backward.

Under ``create_graph`` (a gradient penalty) the gradients are right, but they reach a parameter
through the recompute's nodes and the Function's edge instead of the forward's own nodes, so
three or more contributions to one parameter may be summed in another order: measured, 1.5e-8 on
one weight of a small MLP (``test_a_gradient_penalty_...``). ``on_create_graph`` is told, and the
runner runs full blocks with torch's non-reentrant checkpoint from then on, whose gradients are
the plain step's bits.

The recompute's own saves go to an identity hook pair on top of the engine's: they are the
block's working set, which the runner holds on the engine's books instead (as checkpoint keeps
them in its own storage).

A reentrant checkpoint of the user's inside such a block raises in the nested
``autograd.grad`` (it only runs under a plain ``backward()``): the block is then run again and
its gradients accumulated as that checkpoint does (``torch.autograd.backward``: the parameters'
into their ``.grad``), and ``on_reentrant`` is told, so that the runner's later calls of the
block go that way at once (``accumulate``), under the limits the user's checkpoint sets anyway.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

_NESTED_REENTRANT = "torch.utils.checkpoint is incompatible"   # torch's own message


def _same(t):
    return t


class _Forward:
    """The forward's RNG states and autocast settings, to run the recompute in.

    Where the forward drew no random number (its RNG states the same after as before: a block
    without dropout) the recompute draws none either, and where autocast is off both in the
    forward and around the recompute, there is nothing to restore: ``restored`` then enters
    nothing. Forking the RNG and entering autocast took about 1.2% of the demo's all-full step
    on this project's 2-core CPU (cProfile: 1.7 ms of 145 ms, 16 recomputes)."""
    __slots__ = ("cpu_rng", "devices", "device_rng", "autocast", "cache", "drew")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        self.device_rng = [torch.cuda.get_rng_state(d) for d in self.devices]
        types = ("cpu", "cuda") if self.devices else ("cpu",)
        self.autocast = [(dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
                         for dt in types]
        self.cache = torch.is_autocast_cache_enabled()
        self.drew = True

    def after(self) -> None:
        """The forward has run: did it draw from any RNG whose state this holds?"""
        self.drew = not (torch.equal(torch.get_rng_state(), self.cpu_rng) and all(
            torch.equal(torch.cuda.get_rng_state(d), state)
            for d, state in zip(self.devices, self.device_rng)))

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            if self.drew:
                stack.enter_context(torch.random.fork_rng(devices=self.devices,
                                                          device_type="cuda"))
                torch.set_rng_state(self.cpu_rng)
                for d, state in zip(self.devices, self.device_rng):
                    torch.cuda.set_rng_state(state, d)
            for dt, enabled, dtype in self.autocast:
                if enabled or torch.is_autocast_enabled(dt):
                    stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled,
                                                       cache_enabled=self.cache))
            yield


class FullCall:
    """One block call run fully recomputed: ``fn(*tensors)`` is the block on the call's tensors,
    ``params`` the block's parameters that require grad, ``recompute_ctx()`` a context entered
    around each recompute (the runner's marks and holds)."""

    def __init__(self, fn: Callable, params: list, recompute_ctx: Callable,
                 on_reentrant: Callable[[], None], on_create_graph: Callable[[], None],
                 reached: Callable[[], list], on_found: Callable[[list, bool], None],
                 walk: bool = True, accumulate: bool = False) -> None:
        self.fn, self.params = fn, params
        self.recompute_ctx, self.on_reentrant = recompute_ctx, on_reentrant
        self.on_create_graph = on_create_graph
        # reached(): parameters of modules outside the block its last recompute called;
        # on_found(leaves, walked): the leaves not the block's this backward reached.
        self.reached, self.on_found, self.walk = reached, on_found, walk
        self.accumulate = accumulate
        self.forward_state: Optional[_Forward] = None
        self.spec = None
        self.others: list = []          # the output's non-tensor leaves
        self.is_tensor: list[bool] = []

    def run(self, tensors: list):
        outs = _Full.apply(self, len(tensors), *tensors, *self.params)
        it, other = iter(outs), iter(self.others)
        return tree_unflatten([next(it) if t else next(other) for t in self.is_tensor],
                              self.spec)

    # ------------------------------------------------------------------ inside the Function
    def forward(self, tensors: tuple) -> tuple:
        self.forward_state = state = _Forward(tensors)
        leaves, self.spec = tree_flatten(self.fn(*tensors))
        state.after()
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.others = [x for x, t in zip(leaves, self.is_tensor) if not t]
        return tuple(x for x, t in zip(leaves, self.is_tensor) if t)

    def _again(self, inputs: list, grads: tuple) -> tuple[list, list]:
        """Run the block again on ``inputs``; its tensor outputs that require grad and were
        given a gradient in ``grads``, and those gradients."""
        with self.forward_state.restored(), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(_same, _same), self.recompute_ctx():
            out = self.fn(*inputs)
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, saved: tuple, need: tuple, grads: tuple) -> tuple:
        if self.accumulate:
            return self._accumulated(saved, need, grads)
        n = len(saved)
        create = torch.is_grad_enabled()        # create_graph: through the original inputs
        if create:
            self.on_create_graph()
        inputs = [t if create and need[k] else t.detach().requires_grad_(need[k])
                  for k, t in enumerate(saved)]
        wanted = [k for k in range(n + len(self.params)) if need[k]]
        res: list = [None] * (n + len(self.params))
        ys, gs = self._again(inputs, grads)
        if not ys:
            self.reached()                      # (emptied for the next recompute)
            return tuple(res)
        known = {id(t) for t in inputs} | {id(p) for p in self.params}
        foreign = [t for t in self.reached() if id(t) not in known]
        if self.walk:
            known.update(id(t) for t in foreign)
            foreign += _foreign(ys, inputs, known, create)
        if foreign or self.walk:
            self.on_found(foreign, self.walk)
        try:
            if wanted:
                got = torch.autograd.grad(
                    ys, [inputs[k] if k < n else self.params[k - n] for k in wanted], gs,
                    allow_unused=True, create_graph=create, retain_graph=bool(foreign) or None)
                for k, g in zip(wanted, got):
                    res[k] = g
            if foreign:
                torch.autograd.backward(ys, gs, inputs=foreign, create_graph=create)
        except RuntimeError as e:
            if _NESTED_REENTRANT not in str(e):
                raise
            self.on_reentrant()
            return self._accumulated(saved, need, grads)
        return tuple(res)

    def _accumulated(self, saved: tuple, need: tuple, grads: tuple) -> tuple:
        """The user's reentrant checkpoint inside: run again, and accumulate as it does."""
        n = len(saved)
        inputs = [t.detach().requires_grad_(need[k]) for k, t in enumerate(saved)]
        ys, gs = self._again(inputs, grads)
        self.reached()          # (every leaf reached is accumulated here: none to pass on)
        if ys:
            torch.autograd.backward(ys, gs)
        return tuple(inputs[k].grad if k < n and need[k] else None
                     for k in range(n + len(self.params)))


# The node type of a leaf's gradient accumulator (its ``variable`` is the leaf); None on a torch
# that does not expose it, where each node is asked for a ``variable`` instead.
_ACCUMULATE = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def _foreign(ys: list, inputs: list, known: set, create: bool) -> list:
    """Leaves requiring grad that the graph of ``ys`` reaches whose ids are not in ``known``
    (which this extends; where ``create``, the ``inputs`` are the forward's own tensors: the walk
    stops at them instead of running into the graph before the block).

    Every full recompute under the engine is walked (``module_hooks.Quiet``), so the walk is
    kept lean: the node's type tells a leaf's accumulator, where asking every node for a
    ``variable`` raised and caught an AttributeError per node, and a node already seen is not
    pushed again. A layer of the demo's Llama (78 nodes) took 24 us alone against 44 us pushing
    every edge and 81-133 us asking (this project's 2-core CPU). Inside a step it takes 109-134 us
    (142 us pushing every edge): mostly the first touch of the graph the recompute just made, whose
    second walk took 32 us."""
    seen = {t.grad_fn for t in inputs if t.grad_fn is not None} if create else set()
    todo, found = [y.grad_fn for y in ys if y.grad_fn is not None and y.grad_fn not in seen], []
    add, pop, push, accumulate = seen.add, todo.pop, todo.append, _ACCUMULATE
    add(None)                                   # (an edge to nothing: never pushed)
    while todo:
        f = pop()
        if f in seen:
            continue
        add(f)
        v = (f.variable if type(f) is accumulate else None) if accumulate is not None else \
            getattr(f, "variable", None)
        if v is not None:                            # a leaf
            if id(v) not in known:
                known.add(id(v))
                found.append(v)
            continue
        for g, _ in f.next_functions:
            if g not in seen:
                push(g)
    return found


class _Full(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: FullCall, n: int, *tensors):
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors[:n])
        return call.forward(tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + ctx.call.backward(ctx.saved_tensors, ctx.needs_input_grad[2:],
                                                grads)
