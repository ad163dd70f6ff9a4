"""`megatron-rl convert`: HF ↔ Megatron dist-checkpoint conversion.

`job.py` is the job as data (torch-free), `launcher.py` starts the torchrun workers (torch-free),
`worker.py` is what every worker runs (`python -m megatron_rl.convert`, `__main__.py`).
"""
