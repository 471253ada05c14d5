#!/usr/bin/env python3
"""The hapd worker: ``torchrun --nproc-per-node N worker.py ...`` (HAP-compatible entry); see hapd/harness/worker.py."""
from hapd.util import exit_process
from hapd.harness.worker import main
exit_process(main())
