#!/usr/bin/env python3
"""Fully sharded data-parallel baseline (PyTorch FSDP): ``torchrun --nproc-per-node N fsdp.py ...`` — an alias of ``python -m hapd.fsdp``: hapd's entry points live in hapd/ (:mod:`hapd.fsdp`)."""
import runpy

runpy.run_module("hapd.fsdp", run_name="__main__", alter_sys=True)
