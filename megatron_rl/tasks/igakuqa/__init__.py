"""The built-in `igakuqa` task (Japanese National Medical Licensing Examination): everything about it.

`data.py` reads the benchmark, `prepare.py` writes prompt/SFT files, `scoring.py` is the benchmark's
rule, `report.py`, `table.py` and `compare.py` are the `eval igakuqa|table|compare` reports (with
`stats.py`'s exact McNemar test), `task.py` is the `TASK`. matplotlib is imported only when a plot
is drawn.
"""
