"""hapd's one exception hierarchy.

Every error hapd raises on bad input is a :class:`HapdError`. Errors from the Rust
core arrive as the class named by the core (``GraphFormatError``, ``ShapeError``, …)
and carry the offending ``node`` and ``field`` when there is one, so a caller can
point at the problem without parsing the message.
"""

from __future__ import annotations

import re


class HapdError(Exception):
    """Base class of every hapd error."""

    def __init__(self, message: str, *, node: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.node = node
        self.field = field


class GraphError(HapdError):
    """A graph (exported program or graph IR) cannot be used."""


class GraphFormatError(GraphError):
    """The bytes are not a graph IR document (truncated, garbage, wrong format)."""


class GraphVersionError(GraphError):
    """The graph IR declares a version this hapd does not read."""


class GraphValidationError(GraphError):
    """A node or field of the graph IR is inconsistent (dangling reference, bad field)."""


class ShapeError(GraphValidationError):
    """An op's operand shapes do not agree with the op."""


class ExportError(GraphError):
    """A module could not be exported or lowered to the graph IR."""


class UnsupportedOpError(GraphError):
    """An op cannot be handled where it was asked to be (names the op and node)."""

    def __init__(self, message: str, *, op: str | None = None, node: str | None = None, field: str | None = None):
        super().__init__(message, node=node, field=field)
        self.op = op


class ProfileError(HapdError):
    """A cluster profile is missing a field or has a bad value."""


class SynthesisError(HapdError):
    """No program could be synthesized, or the sharding-ratio LP failed."""


class OptionsError(HapdError):
    """Compiler or command options are inconsistent."""


class PlanError(HapdError):
    """A plan file cannot be read or does not match the graph it is applied to."""


class CheckpointError(HapdError):
    """A checkpoint cannot be written, or cannot be read into this model and optimizer."""


class WeightsError(HapdError):
    """A model's weights cannot be materialized from the given source (a name it lacks,
    a shape or dtype it does not match, an initializer that failed)."""


class CollectiveError(HapdError):
    """A collective failed or waited past the process group's timeout: the message names
    the training step and the ranks that were not there."""


class ElasticPause(HapdError):
    """Raised by :meth:`hapd.Elastic.step_done` at a step boundary the launcher paused the
    job at (a host joins), once that step's snapshot reached the daemons, in a rank run
    under :mod:`hapd.elastic.in_place`: the runner parks on it and the rank is switched,
    in its process, into the generation that includes the joining host."""


class ProtocolError(HapdError):
    """A control message is malformed or of an unknown version."""


class AuthError(ProtocolError):
    """A control message failed authentication."""


class DaemonTimeout(ProtocolError):
    """No daemon answered at an address in time."""


class DaemonDown(DaemonTimeout):
    """A daemon that answered before did not answer, and its address now refuses
    connections: nothing listens there (it died or was stopped, its host up)."""


class SnapshotError(HapdError):
    """A training snapshot cannot be stored in a daemon's memory, or is not there to read."""


class RemoteError(HapdError):
    """A daemon answered a request with an error."""


PEER_FAILURE = re.compile(
    r"connection closed by peer|connection reset|broken pipe|timed out|timeout|DistNetworkError|DistBackendError|"
    r"Connection refused|ECONNRESET|gloo/transport|NCCL error|ProcessGroup.*abort", re.IGNORECASE)
"""What a rank's failure says when it failed because a peer went away (not its own
bug): Gloo's and NCCL's errors, a collective's timeout."""


__all__ = ["PEER_FAILURE"] + [name for name, value in list(globals().items()) if isinstance(value, type) and issubclass(value, HapdError)]
