"""`autoplan calibrate`: what this machine's GPU (or CPU) achieves, measured and fitted into the
parameters the cost model reads (cost/calibration.py), and what a rank holds, measured against
cost/memory.py (measure.py).
"""
