#!/usr/bin/env python3
"""Data-parallel baseline (DDP-EV / DDP-CP): ``torchrun --nproc-per-node N ddp.py ...``; see hapd/harness/ddp.py."""
from hapd.runtime.distributed import exit_rank
from hapd.harness.ddp import main
exit_rank(main())
