#!/usr/bin/env python3
"""The hapd worker: ``torchrun --nproc-per-node N worker.py ...`` (HAP-compatible entry) — an alias of ``python -m hapd.worker``: hapd's entry points live in hapd/ (:mod:`hapd.worker`)."""
import runpy

runpy.run_module("hapd.worker", run_name="__main__", alter_sys=True)
