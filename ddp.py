#!/usr/bin/env python3
"""Data-parallel baseline (DDP-EV / DDP-CP): ``torchrun --nproc-per-node N ddp.py ...``; see hapd/harness/ddp.py."""
from hapd.util import exit_process
from hapd.harness.ddp import main
exit_process(main())
