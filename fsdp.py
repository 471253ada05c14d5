#!/usr/bin/env python3
"""Fully sharded data-parallel baseline (PyTorch FSDP): ``torchrun --nproc-per-node N fsdp.py ...``; see hapd/harness/fsdp.py."""
import sys
from hapd.harness.fsdp import main
sys.exit(main())
