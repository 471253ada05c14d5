#!/usr/bin/env python3
"""The hapd worker: ``torchrun --nproc-per-node N worker.py ...`` (HAP-compatible entry); see hapd/harness/worker.py."""
import sys
from hapd.harness.worker import main
sys.exit(main())
