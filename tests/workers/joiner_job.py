"""Joins the cluster and says so."""

import lockstep as ls
ls.MultiWorkerMirroredStrategy()
print('joined', flush=True)
