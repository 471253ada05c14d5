#!/usr/bin/env python3
"""Data-parallel baseline (DDP-EV / DDP-CP): ``torchrun --nproc-per-node N ddp.py ...`` — an alias of ``python -m hapd.ddp``: hapd's entry points live in hapd/ (:mod:`hapd.ddp`)."""
import runpy

runpy.run_module("hapd.ddp", run_name="__main__", alter_sys=True)
