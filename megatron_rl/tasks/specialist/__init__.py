"""The specialist exam (article 001's `specialist_exam_test_v2`): an evaluation-only task (no `TASK`).

`data.py` is the input format and `data prepare specialist`; `table.py` is `eval specialist`, the
paired tables of base + methods (the layouts are IgakuQA's, `tasks/igakuqa/table.py`).
"""
