"""Prints its pid, then sleeps; exits 143 on SIGTERM, saying so."""

import os, signal, sys, time
def bye(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, bye)
print("pid", os.getpid(), flush=True)
time.sleep(120)
