"""The torch-free contract the daemon, the launcher and the ranks share.

- :mod:`~hapd.wire.protocol` — the authenticated ZeroMQ messages: each type declared
  once with its fields, signed, checked against replays;
- :mod:`~hapd.wire.keys` — the cluster key and where it lives;
- :mod:`~hapd.wire.client` — a DEALER client of a daemon;
- :mod:`~hapd.wire.contract` — what they agree on besides messages: job ids, lease
  bounds, the variables a daemon sets for its ranks;
- :mod:`~hapd.wire.switch` — an elastic rank's wait for its ``switch`` order and the
  environment the order gives it;
- :mod:`~hapd.wire.standby` — the hand-over of a rank to a daemon's warm process, and
  which launches one can serve.

Never imports torch.
"""
