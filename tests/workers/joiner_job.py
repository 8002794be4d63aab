"""Joins the cluster and says so; then stays `sys.argv[1]` seconds (0 if not given)."""

import sys
import time

import lockstep as ls

ls.MultiWorkerMirroredStrategy()
print('joined', flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
