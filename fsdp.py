#!/usr/bin/env python3
"""Fully sharded data-parallel baseline (PyTorch FSDP): ``torchrun --nproc-per-node N fsdp.py ...``; see hapd/harness/fsdp.py."""
from hapd.util import exit_process
from hapd.harness.fsdp import main
exit_process(main())
