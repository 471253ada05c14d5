"""Gradient sync of replicated parameters.

A parameter the plan keeps whole on every rank (``Identity``) gets only the part of its
gradient that comes from this rank's share of the loss; :class:`GradSync` sums those
parts over ranks during backward, so every replica ends with the exact gradient.

Gradient accumulation is exact: a backward that finds a gradient which an earlier
backward already summed sets it aside, sums only its own contribution over ranks and
adds the two (``old + new``, as a single device accumulates). Inside
:meth:`GradSync.no_sync` (DDP's ``no_sync``), backwards accumulate their local parts
without communicating; the next backward outside it sums them all at once.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hapd import _core
from hapd.errors import PlanError
from hapd.spmd import collectives


REDUCE_DTYPE = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""A plan's ``reduce_dtype`` as the dtype a bucket is summed in (None: the gradients' own)."""


class GradSync:
    """Sums the gradients of replicated trainable parameters over ranks during backward.

    Parameters are packed into buckets of about ``bucket_bytes`` in reverse order of
    first use (roughly the order backward produces their gradients); a bucket's
    all-reduce starts as soon as all its gradients exist and every earlier bucket has
    started, so all ranks issue the same collectives in the same order (as DDP does).
    The core's cost model charges this sync per bucket of the same size
    (``hapd._core.GRAD_BUCKET_BYTES``). When the last bucket has started, the sums are
    waited for and written back, so the gradients are complete when ``backward()``
    returns.

    With ``hosts`` (several ranks on each of several hosts) a bucket is summed in two
    levels (:func:`hapd.spmd.collectives.two_level_sum_`), pipelined: as soon as it is ready
    it is reduced onto the host's leader, where a helper thread waits for that reduce,
    all-reduces the bucket among the leaders and broadcasts it back, while backward goes
    on producing the next buckets. Only the leaders' all-reduce crosses hosts.

    With ``reduce_dtype`` (bf16 or fp16: FSDP2's ``MixedPrecisionPolicy.reduce_dtype``) a
    bucket is cast to it before the sum and back to the gradients' dtype after: half the
    bytes on the wire, sums rounded to it.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, bucket_bytes: int = _core.GRAD_BUCKET_BYTES,
                 hosts: collectives.HostGroups | None = None, reduce_dtype: torch.dtype | None = None):
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.hosts = hosts
        self._relay: _LeaderRelay | None = None
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes + 1
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if size + nbytes > bucket_bytes or self.buckets[-1][0].dtype != p.dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._handles: list[tuple[Any, Tensor, list[nn.Parameter]]] = []
        self._ready: list[int] = [0] * len(self.buckets)
        self._next = 0
        self.enabled = True
        """False inside :meth:`no_sync`: backwards accumulate local parts only."""
        self._summed: dict[int, weakref.ref] = {}
        """param id -> the gradient tensor the last sum wrote (it holds a summed value)."""
        self._set_aside: dict[int, Tensor] = {}
        """param id -> its summed gradient, set aside while a backward adds a new part."""
        self.active = dist.is_initialized() and dist.get_world_size(group) > 1
        if self.active:
            for p in params:
                p.register_hook(self._before_accumulate(p))
                p.register_post_accumulate_grad_hook(self.grad_ready)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate this rank's parts without communicating; the
        first backward after it sums everything accumulated (as DDP's ``no_sync``).
        Step the optimizer only after such a synchronizing backward."""
        before = self.enabled
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = before

    def _before_accumulate(self, param: nn.Parameter):
        """A hook run before autograd adds a new gradient part to ``param.grad``: a
        gradient an earlier sum wrote is set aside, so that ``param.grad`` holds only
        parts not yet summed over ranks."""
        key = id(param)

        def hook(grad: Tensor) -> None:
            current = param.grad
            ref = self._summed.pop(key, None)
            if current is not None and ref is not None and ref() is current:
                if key in self._set_aside:  # cannot happen: a summed grad is set aside once
                    raise PlanError("gradient sync: a parameter's summed gradient was set aside twice")
                self._set_aside[key] = current
                param.grad = None
            return None

        return hook

    def reset(self) -> None:
        """Start a new backward pass; an incomplete previous one is an error."""
        for bucket in self.buckets:  # set-aside gradients of parameters zeroed since are dropped
            for p in bucket:
                if p.grad is None:
                    self._set_aside.pop(id(p), None)
        if self._next not in (0, len(self.buckets)) or any(self._ready[self._next :]):
            missing = [n for bucket in self.buckets[self._next :] for n in bucket if n.grad is None]
            raise PlanError(
                f"gradient sync of the previous backward did not finish: {len(missing)} replicated "
                "parameter(s) received no gradient"
            )
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._handles = []
        self._relay = None

    def grad_ready(self, param: nn.Parameter) -> None:
        """``param``'s gradient is complete: count it into its bucket and launch the
        bucket's sum when it is full (the hook backward calls as each gradient lands;
        the profiler calls it to time the sync without a backward)."""
        if not self.enabled:
            return
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1
        if self._next == len(self.buckets):
            self._finish()

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        if self.reduce_dtype is not None and flat.is_floating_point():
            flat = flat.to(self.reduce_dtype)
        hosts = self.hosts
        if hosts is None:
            handle = dist.all_reduce(flat, group=self.group, async_op=True)
        elif hosts.leaders is None:  # not a leader: send this host's part, await the sum
            dist.reduce(flat, dst=hosts.leader, group=hosts.local, async_op=True)
            handle = dist.broadcast(flat, src=hosts.leader, group=hosts.local_back, async_op=True)
        else:
            if self._relay is None:
                self._relay = _LeaderRelay(hosts)
            handle = self._relay.submit(dist.reduce(flat, dst=hosts.leader, group=hosts.local, async_op=True), flat)
        self._handles.append((handle, flat, bucket))

    def _finish(self) -> None:
        if self._relay is not None:
            self._relay.close()  # re-raises what failed in the helper thread
            self._relay = None
        for handle, flat, bucket in self._handles:
            handle.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
                earlier = self._set_aside.pop(id(p), None)
                if earlier is not None:
                    p.grad = earlier.add_(p.grad)  # old + new, as a single device accumulates
                self._summed[id(p)] = weakref.ref(p.grad)
        self._handles = []


class _Done:
    """A handle whose work is already waited for."""

    def wait(self) -> bool:
        return True


class _LeaderRelay:
    """A host leader's helper thread for one backward pass: for each bucket, in order,
    wait for its reduce onto this rank, all-reduce it among the leaders, broadcast it to
    the host. Collectives are issued on the leaders' and the broadcast group only, each
    in bucket order, so every rank sees them in the same order."""

    def __init__(self, hosts: collectives.HostGroups):
        self.hosts = hosts
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.sent: list[Any] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hapd-grad-relay", daemon=True)
        self.thread.start()

    def submit(self, reduce: Any, flat: Tensor) -> _Done:
        self.todo.put((reduce, flat))
        return _Done()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            if self.error is not None:
                continue  # drain: the failure is reported by close()
            reduce, flat = item
            try:
                reduce.wait()
                dist.all_reduce(flat, group=self.hosts.leaders)
                self.sent.append(dist.broadcast(flat, src=self.hosts.leader, group=self.hosts.local_back,
                                                async_op=True))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self.error = exc

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        for handle in self.sent:
            handle.wait()
