"""Trace once, replay many times: a step function of device tensors captured as ONE XLA graph
on its first call and then run without executing any Python of the model.

torch-xla's lazy mode re-traces the model in Python at every call (about 1 ms per decoder
layer) before it finds the cached executable; for a decode step that is most of the time.
:class:`ReplayedStep` traces ``fn`` once, compiles the graph of its outputs, records which
graph inputs are the step's arguments (the rest, e.g. the weights, are bound at capture) and
from then on calls the cached executable directly (the mechanism torch-xla's dynamo bridge is
built on, without dynamo's guards and per-call input synchronisation).

Contract for ``fn(*args) -> list[Tensor]``: its result depends on the tensors in ``args``
and on tensors that do not change between calls (weights, constants); it may update ``args``
in place (a KV cache): the updated values come back as results (``fn``'s own when it returns
the argument, else in ``updated``), never written back into the argument. A result that is
an argument left unchanged (e.g. the cache of a layer that reads another layer's) is no
output of the graph: the replay returns that call's argument there.
Host values that change between calls must come in as tensors. On an eager device there is
nothing to capture: ``fn`` is called each time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from ..backend import xla as _xla


class _Graph(NamedTuple):
    hash: Any
    slots: list  # per graph input: the argument's index, or a bound value in a 1-tuple
    n_results: int  # fn's results
    computed: list[int]  # the results the graph computes, in its output order
    passed: dict[int, int]  # result -> the argument it is, unchanged
    updated: list[int]  # arguments updated in place and not returned


class ReplayedStep:
    """``step(*args)`` -> ``(outputs, updated)``: ``outputs`` are ``fn``'s results, ``updated``
    the new values of the arguments ``fn`` updated in place (``None`` for the others), so a
    caller carries state by passing ``updated[i]`` back in."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]]):
        self.fn = fn
        self._graph: _Graph | None = None
        self.traces = 0

    def __call__(self, *args: torch.Tensor):
        if args and args[0].device.type != "xla":
            return list(self.fn(*args)), [None] * len(args)
        import torch_xla

        X = torch_xla._XLAC
        if self._graph is None:
            graph = self._graph = self._capture(args)
            first = self._first_inputs
            del self._first_inputs
            res = X._run_cached_graph(graph.hash, first)
        else:
            graph = self._graph
            inputs = [args[s] if isinstance(s, int) else s[0] for s in graph.slots]
            res = X._run_cached_graph(graph.hash, inputs)
        return self._split(graph, res, args)

    @staticmethod
    def _split(graph: _Graph, res, args: Sequence[torch.Tensor]):
        outputs: list[torch.Tensor | None] = [None] * graph.n_results
        for k, t in zip(graph.computed, res):
            outputs[k] = t
        for k, i in graph.passed.items():
            outputs[k] = args[i]
        updated: list[torch.Tensor | None] = [None] * len(args)
        for i, t in zip(graph.updated, res[len(graph.computed) :]):
            updated[i] = t
        return outputs, updated

    def _capture(self, args: Sequence[torch.Tensor]) -> _Graph:
        import torch_xla

        X = torch_xla._XLAC
        torch_xla.sync()  # every argument must be device data, not pending computation
        _xla.wait_own_device()  # not every device: the other ranks' threads may wait on it
        arg_of_id = {X._xla_get_tensor_id(a): i for i, a in enumerate(args)}
        outputs = list(self.fn(*args))
        self.traces += 1
        dirty = X._check_tensor_need_materialization(list(args))
        index = {id(a): i for i, a in enumerate(args)}
        passed = {
            k: index[id(t)]
            for k, t in enumerate(outputs)
            if id(t) in index and not dirty[index[id(t)]]
        }
        computed = [k for k in range(len(outputs)) if k not in passed]
        returned = {id(t) for t in outputs}
        updated = [i for i, d in enumerate(dirty) if d and id(args[i]) not in returned]
        roots = [outputs[k] for k in computed] + [args[i] for i in updated]
        ids, values = X._get_tensors_xla_device_data_node(roots)
        # A slot is the index of the argument fed there at each call, or a bound value
        # (wrapped in a tuple) that stays the same: weights, constants of the trace.
        slots = [arg_of_id[t] if t in arg_of_id else (v,) for t, v in zip(ids, values)]
        graph_hash = X._get_graph_hash(roots)
        X._xla_warm_up_cache(roots, [])
        self._first_inputs = list(values)  # the arguments' values before the in-place updates
        # Drop the traced computation from every live tensor (the arguments updated in place
        # now hold it): nothing of it may run again outside the replay.
        X._clear_pending_irs(str(torch_xla.device()))
        return _Graph(graph_hash, slots, len(outputs), computed, passed, updated)


class StepGraphs:
    """A generator's step functions by key (a graph shape): on an XLA device with ``replay``,
    each a :class:`ReplayedStep` captured at its key's first call; otherwise the function is
    built and called every time, then (XLA) the graph is cut: torch-xla's plain lazy mode."""

    def __init__(self, device: torch.device, replay: bool = True):
        self.device = device
        self.replay = replay and device.type == "xla"
        self._steps: dict[Hashable, ReplayedStep] = {}

    @property
    def traces(self) -> int:
        """How many times the model's Python ran to capture a graph (replay mode)."""
        return sum(s.traces for s in self._steps.values())

    def run(
        self,
        key: Hashable,
        build: Callable[[], Callable[..., Sequence[torch.Tensor]]],
        args: Sequence[torch.Tensor],
        before_capture: Callable[[], object] | None = None,
    ) -> list[torch.Tensor]:
        """The outputs of ``key``'s step on ``args``; ``build()`` makes the step function (in
        replay mode only for its capture, after ``before_capture()``)."""
        if self.replay:
            if key not in self._steps:
                if before_capture is not None:
                    before_capture()
                self._steps[key] = ReplayedStep(build())
            outputs, _ = self._steps[key](*args)
            return outputs
        outputs = list(build()(*args))
        if self.device.type == "xla":
            _xla.xm().mark_step()
        return outputs


class StepGraphsOwner:
    """Mixin of the generators: what their :class:`StepGraphs` (``self._graphs``) counts."""

    _graphs: StepGraphs

    @property
    def replay(self) -> bool:
        """True when steps are traced once and then replayed."""
        return self._graphs.replay

    @property
    def traces(self) -> int:
        """How many times the model's Python ran to capture a graph (replay mode)."""
        return self._graphs.traces
