"""hapd's launcher: ``python -m launcher`` / ``./run_all`` (see :mod:`launcher.job`).

Fans a job out to the hapd daemons of a cluster over ZeroMQ (:mod:`launcher.hosts` for
host files, :mod:`launcher.job` for the checks, synchronized start, streaming and
failure propagation, :mod:`launcher.report` for the timing table). Never imports torch.
"""
