#!/usr/bin/env python3
"""Data-parallel baseline (DDP-EV / DDP-CP): ``torchrun --nproc-per-node N ddp.py ...``; see hapd/harness/ddp.py."""
import sys
from hapd.harness.ddp import main
sys.exit(main())
